"""How a bfloat16 model runs on this CPU, and why: read once at start-up.

Two choices, each a pure function of the CPU's flags (/proc/cpuinfo), so they are tested for every
kind of host whatever machine runs the tests:
- what the model computes bf16 operands in (model/layers/compute.py): on a host without bf16 dots
  (AVX2, or less) XLA:CPU widens bf16 around every op, slowly; widened once up front, the dots and
  the MLP's elementwise chain run at f32 speed with the same values (bf16 products are exact in
  f32 and every result is rounded where HF rounds). Measured on a loaded 2-core AVX2 host (best of
  10): [2048, 512] x [512, 2816] dot 469 ms bf16 vs 292 ms widened, SiLU * up on [2048, 1408]
  26.8 vs 2.9 ms. With amx_bf16 or avx512_bf16 XLA:CPU has native bf16 dots, so the operands stay
  bf16 there (kept as it was: no such host has been available to measure the widening on).
- what its caches are kept in: bf16 on a host with native bf16 where the C++ attention and
  cache-write kernels built (pallas_kernels/ragged_paged_attention/native.py: they read and write
  the pages in place, and a decode step reads half the bytes), f32 everywhere else. Without those
  kernels the step's cost is XLA's paged-attention gathers and scatters, which move bf16 slowly
  (measured: a whole bf16 step with bf16 caches ran 3.7x slower than with f32 caches); on AVX2 bf16
  caches would add conversions to each gather as well (and its widened operands were not
  measured with the kernels); bf16 keys and values are exact in f32. A model whose attention
  keeps no K/V pool (an MLA latent: DeepSeek, Kimi-Linear) is never served by those kernels,
  so its caches are f32 too (a tiny DeepSeek-V3 bf16 run, 32 requests, AMX host: 3.69 s with
  bf16 caches, 2.57 s with f32, the same tokens).
- whether a model whose operands are widened also keeps its dense weights in f32, widened once at
  load instead of in every dot (model/layers/compute.py): where the f32 copy takes at most half
  the memory available beside the caches the runner has planned, since it doubles the weights'
  bytes.
No XLA:CPU option is changed: --xla_cpu_use_onednn and --xla_cpu_use_xnnpack were measured on the
AVX2 host and neither made the bf16 dots reach the widened ones; fast math would change values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pallas_kernels.platform import host_cpu_flags, proc_fields
from pallas_kernels.ragged_paged_attention import native

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class Bf16Choice:
    host: str  # "amx_bf16", "avx512_bf16", "avx2" or "other": the best bf16 support found
    compute_dtype: str  # what a bfloat16 model's dots and MLP chain take their operands in
    cache_dtype: str  # what a bfloat16 model's caches are kept in on the jnp path
    reason: str


def choose(flags: frozenset[str], native_kernels: bool | None = False) -> Bf16Choice:
    """How a bfloat16 model runs on a CPU with these /proc/cpuinfo flags; `native_kernels`:
    whether the C++ attention and cache-write kernels built here (ragged_paged_attention/native.py),
    None for a model they never serve (it keeps no attention K/V pool: MLA latents, encoders)."""
    flag = next((f for f in NATIVE_BF16_FLAGS if f in flags), None)
    if flag is not None and native_kernels is None:
        return Bf16Choice(
            flag,
            "bfloat16",
            "float32",
            f"{flag}: bf16 dots are native, so operands stay bf16; the model keeps no attention "
            "K/V pool the C++ kernels read (an encoder caches nothing; an MLA latent is read "
            "through XLA's gathers, which move bf16 slowly: a DeepSeek-V3 bf16 run 1.44x slower "
            "with bf16 caches), and bf16 values are exact in f32",
        )
    if flag is not None and native_kernels:
        return Bf16Choice(
            flag,
            "bfloat16",
            "bfloat16",
            f"{flag}: bf16 dots are native, so operands stay bf16; the C++ kernels write and "
            "read the caches in place, so they hold bf16 (half the bytes each decode step reads)",
        )
    if flag is not None:
        return Bf16Choice(
            flag,
            "bfloat16",
            "float32",
            f"{flag}: bf16 dots are native, so operands stay bf16; but XLA:CPU gathers and "
            "scatters bf16 slowly (steps 3.7x slower with bf16 caches), and bf16 keys and "
            "values are exact in f32 (the C++ kernels that would serve bf16 caches did not build)",
        )
    if "avx2" in flags:
        return Bf16Choice(
            "avx2",
            "float32",
            "float32",
            "avx2 without avx512_bf16 or amx_bf16: XLA:CPU widens bf16 around every op, slowly, "
            "so operands are widened to f32 once (same values, 1.6x faster dots), and bf16 "
            "caches would add conversions to each gather",
        )
    return Bf16Choice(
        "other",
        "float32",
        "float32",
        "no avx2: no bf16 dots, so operands are widened to f32 once as on avx2, and caches are "
        "f32, the layout measured to be fast on every CPU",
    )


_STAY_BF16 = "so they stay bf16 and each large dot widens them"


def keep_weights_wide(
    num_weights: int | None, available_bytes: int | None, cache_bytes: int = 0
) -> tuple[bool, str]:
    """Whether a bf16 model of `num_weights` parameters, on a host that widens its operands, keeps
    its dense weights in f32, and why: where their f32 copy takes at most half of the memory
    available beside the `cache_bytes` its caches will take."""
    if num_weights is None or available_bytes is None:
        unknown = "the checkpoint's size" if num_weights is None else "the memory available"
        return False, f"{unknown} is unknown, {_STAY_BF16}"
    room = available_bytes - cache_bytes
    beside = f" beside the caches' {cache_bytes / 2**30:.2f} GiB" if cache_bytes else ""
    need = f"their f32 copy ({4 * num_weights / 2**30:.2f} GiB)"
    of_room = f"the {max(room, 0) / 2**30:.1f} GiB available{beside}"
    if 4 * num_weights > room // 2:
        return False, f"{need} would take more than half of {of_room}, {_STAY_BF16}"
    return True, f"{need} takes at most half of {of_room}, and no dot then widens them"


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes; None where it cannot be read."""
    for key, value in proc_fields(meminfo):
        if key == "MemAvailable" and value.split():
            return int(value.split()[0]) * 1024  # kB
    return None


@cache
def host_choice(head_dim: int | None) -> Bf16Choice:
    """This host's choice for a model whose attention K/V pools have head dim `head_dim` (the C++
    kernels are built per head dim; None: it keeps no such pool), logged once."""
    kernels = None if head_dim is None else native.available(head_dim)
    choice = choose(host_cpu_flags(), kernels)
    log.info(
        "bfloat16 on this CPU (%s): operands in %s, caches in %s, because %s",
        choice.host,
        choice.compute_dtype,
        choice.cache_dtype,
        choice.reason,
    )
    return choice
