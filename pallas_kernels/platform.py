"""Facts about the device a kernel will run on, shared by every op's launcher and heuristics."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import jax
from jax._src import xla_bridge
from jax.experimental.pallas import triton as plt


def current_platform() -> str:
    """ "cpu", "cuda" or "rocm": jax.default_backend() says "gpu" for both GPU vendors, while
    kernels are declared (and tuned) per vendor."""
    return xla_bridge.canonicalize_platform(jax.default_backend())


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: interpret where Pallas cannot compile (the CPU), compile on GPUs."""
    if interpret is not None:
        return interpret
    return jax.default_backend() == "cpu"


def num_cores() -> int:
    """Streaming multiprocessors / compute units of the default device; CPU cores on the CPU."""
    dev = jax.devices()[0]
    count = getattr(dev, "core_count", None)
    if isinstance(count, int) and count > 0:
        return count
    return os.cpu_count() or 1


def proc_fields(path: Path) -> list[tuple[str, str]]:
    """(key, value) of each `key: value` line of a /proc file; none where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [
        (key.strip(), value) for key, _, value in (ln.partition(":") for ln in text.splitlines())
    ]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of the first processor in `cpuinfo`; none where it cannot be read."""
    for key, value in proc_fields(cpuinfo):
        if key in ("flags", "Features"):  # x86 / arm64
            return frozenset(value.split())
    return frozenset()


@cache
def host_cpu_flags() -> frozenset[str]:
    """This host's CPU flags, read once."""
    return cpu_flags()


def cache_root() -> Path:
    """vlax's cache directory: `$VLAX_CACHE_DIR` if set, else `~/.cache/vlax`."""
    env = os.environ.get("VLAX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "vlax"


def triton_params(num_warps: int = 4, num_stages: int | None = None) -> plt.CompilerParams:
    """Always passed explicitly: the params' type is what selects the Triton lowering (kernels.md C.1)."""
    if num_stages is None:
        num_stages = 1 if current_platform() == "rocm" else 2
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
