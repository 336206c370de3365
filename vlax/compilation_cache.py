"""JAX's persistent compilation cache, on by default in vlax's cache directory.

Compiling the step for each batch shape is most of a first `generate`'s wait; with the cache a
second process on the same checkpoint (same shapes, same JAX and XLA flags) loads the compiled
programs from disk instead (`LLM(compilation_cache=False)` / `vlax generate --no-compilation-cache`
leave JAX's settings alone). The directory is `$VLAX_CACHE_DIR/jax`, else `~/.cache/vlax/jax`,
unless JAX already has one (`JAX_COMPILATION_CACHE_DIR` or `jax.config`): that one is kept.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where vlax keeps compiled programs: `cache_root()/jax`."""
    from pallas_kernels.platform import cache_root

    return cache_root() / "jax"


def enable() -> Path:
    """Turn JAX's persistent compilation cache on and return its directory. Every program is
    cached, however quick to compile or small (JAX's defaults skip those under a second, which
    is nearly all of a small model's): together they are the start-up."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        log.info("JAX compilation cache: %s (already set, kept)", current)
        return Path(current)
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    log.info("JAX compilation cache: %s", directory)
    return directory
