"""What a bfloat16 model keeps its caches in on this CPU, and why: read once at start-up.

The decision is a pure function of the CPU's flags (/proc/cpuinfo), so it is tested for every
kind of host whatever machine runs the tests:
- native bf16 (amx_bf16, avx512_bf16): XLA:CPU computes bf16 dots natively; the caches stay f32
  all the same, because the step's cost there is the paged-attention gathers and scatters, and
  XLA:CPU moves bf16 through them slowly (measured: a whole bf16 step with bf16 caches ran 3.7x
  slower than with f32 caches); bf16 keys and values are exact in f32.
- AVX2 without bf16: XLA:CPU widens bf16 to f32 around each op, so bf16 caches would add
  conversions to the gathers as well (not measured separately): f32.
- anything else (no AVX2, not x86): f32, the one layout measured to be fast everywhere.
So today every host keeps f32 caches; what differs, and is logged, is the reason. No XLA:CPU
option is changed: none has been measured to help either kind of host yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class Bf16Choice:
    host: str  # "amx_bf16", "avx512_bf16", "avx2" or "other": the best bf16 support found
    cache_dtype: str  # what a bfloat16 model's caches are kept in on the jnp path
    reason: str


def choose(flags: frozenset[str]) -> Bf16Choice:
    """The cache dtype of a bfloat16 model on a CPU with these /proc/cpuinfo flags."""
    native = next((f for f in NATIVE_BF16_FLAGS if f in flags), None)
    if native is not None:
        return Bf16Choice(
            native,
            "float32",
            f"{native}: bf16 dots are native, but XLA:CPU gathers and scatters bf16 slowly "
            "(steps 3.7x slower with bf16 caches), and bf16 keys and values are exact in f32",
        )
    if "avx2" in flags:
        return Bf16Choice(
            "avx2",
            "float32",
            "avx2 without avx512_bf16 or amx_bf16: bf16 is widened to f32 for every op, so bf16 "
            "caches would add conversions to each gather",
        )
    return Bf16Choice(
        "other", "float32", "no avx2: f32 caches, the layout measured to be fast on every CPU"
    )


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of the first processor in `cpuinfo`; none where it cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / arm64
            return frozenset(value.split())
    return frozenset()


@cache
def host_choice() -> Bf16Choice:
    """This host's choice, logged once."""
    choice = choose(cpu_flags())
    log.info(
        "bfloat16 on this CPU (%s): caches in %s, because %s",
        choice.host,
        choice.cache_dtype,
        choice.reason,
    )
    return choice
