"""C++ kernels for the CPU, compiled on first use with the host's compiler into vlax's cache.

A kernel is one C++ source registering an XLA FFI handler (jaxlib ships the FFI headers), with the
headers beside it. It is built for this host (`-march=native`, so the library's name carries a hash
of the source and those headers, the compiler's version, the flags, jaxlib's version and the CPU's
flags: a cache directory shared by different hosts never serves one of them another's build) and
written by rename, so processes building at once each see a whole library. Where no compiler works,
`build` raises `BuildError` with the compiler's own message, and the caller keeps its jnp path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import jax.ffi
import jaxlib

from pallas_kernels.platform import cache_root, host_cpu_flags

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


class BuildError(RuntimeError):
    """A native kernel could not be compiled here (the message says why)."""


def compiler() -> str:
    """`$CXX` if set, else the first of g++, c++, clang++ on PATH."""
    env = os.environ.get("CXX")
    if env:
        return env
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return name
    raise BuildError("no C++ compiler: set CXX or install g++ (apt-get install g++)")


@cache
def _version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"C++ compiler {cxx!r} does not run: {e}") from e
    if done.returncode:
        raise BuildError(f"C++ compiler {cxx!r} --version failed: {done.stderr.strip()}")
    return done.stdout


def build(source: Path, defines: tuple[tuple[str, int], ...] = ()) -> Path:
    """The shared library of `source` for this host, with these preprocessor `defines` (name,
    value), compiled unless already in the cache."""
    cxx = compiler()
    include = jax.ffi.include_dir()
    flags = (*FLAGS, *(f"-D{name}={value}" for name, value in defines))
    key = hashlib.sha256()
    # The source and every header beside it (what it may include).
    for part in (source, *sorted(source.parent.glob("*.h"))):
        key.update(part.read_bytes())
    for part in (_version(cxx).encode(), " ".join(flags).encode()):
        key.update(part)
    key.update(jaxlib.__version__.encode())
    key.update(" ".join(sorted(host_cpu_flags())).encode())
    directory = cache_root() / "native"
    named = "".join(f"-{name.lower()}{value}" for name, value in defines)
    target = directory / f"{source.stem}{named}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / target.name
        command = [cxx, *flags, "-isystem", include, str(source), "-o", str(built)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"{' '.join(command)}: {e}") from e
        if done.returncode:
            raise BuildError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        os.replace(built, target)
    return target


@cache
def load(
    source: Path, symbol: str, target: str, defines: tuple[tuple[str, int], ...] = ()
) -> Path | None:
    """Build `source` (`build`) and register its FFI handler `symbol` with XLA as `target` on the
    CPU, once per process; None, with the reason logged once, where it cannot be built here."""
    try:
        path = build(source, defines)
    except BuildError as e:
        log.warning("native CPU kernel %s unavailable, using the jnp path: %s", target, e)
        return None
    handler = getattr(ctypes.cdll.LoadLibrary(str(path)), symbol)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    log.info("native CPU kernel %s: %s", target, path)
    return path
