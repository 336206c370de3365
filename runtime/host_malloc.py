"""glibc malloc set to keep freed host buffers mapped, on by default.

XLA:CPU takes every step's temporaries and outputs from malloc. glibc serves a block above its
mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it when freed, and trims the top
of its heap when enough is free, so each step faults its buffers in again, page by page: about
1.5 million page faults per run of `benchmarks/offline_throughput.py`'s vlax side, 4-6 s of
system time and ~10% of its CPU time; one layer's decode attention spent 40 of its 59 CPU-ms in
the kernel. With mmap off for large blocks, no trimming and one arena (so XLA's worker threads
reuse the same freed blocks rather than mapping arenas of their own), those buffers stay mapped
and are reused, and the process's resident size stays at its high-water mark instead of shrinking
between steps, as an inference engine's working set does anyway.

`LLM(keep_host_buffers=False)` (EngineConfig) / `vlax ... --no-keep-host-buffers` leave malloc
alone. Other C libraries (musl, macOS) have no mallopt: logged and left alone.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# (mallopt parameter, its number in malloc.h, value)
SETTINGS = (
    ("M_MMAP_MAX", -4, 0),  # large blocks from the heap, never fresh mappings
    ("M_TRIM_THRESHOLD", -1, 2**31 - 1),  # mallopt takes an int: its largest
    ("M_TOP_PAD", -2, 64 << 20),  # grow the heap in steps of 64 MiB
    ("M_ARENA_MAX", -8, 1),
)

_done = False


def keep_freed_buffers() -> bool:
    """Apply SETTINGS once per process; True where glibc took them all."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        log.info("host malloc left alone: not glibc (no mallopt)")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    refused = [name for name, param, value in SETTINGS if mallopt(param, value) != 1]
    if refused:
        log.warning(
            "host malloc: glibc %s refused %s; freed buffers may be unmapped", version, refused
        )
        return False
    _done = True
    log.info(
        "host malloc: glibc %s keeps freed buffers mapped (%s): XLA:CPU's per-step buffers "
        "are reused instead of faulted in each step",
        version,
        ", ".join(f"{name}={value}" for name, _, value in SETTINGS),
    )
    return True
