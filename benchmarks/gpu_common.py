"""The shape of one GPU kernel benchmark case, shared by every `benchmarks/gpu_<op>.py` module."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class Case:
    """One kernel call: build inputs, run the Pallas path and the jnp path, compare, time both.

    `pallas(interpret)` and `reference()` return jittable functions of the same arguments; their
    outputs are pytrees of arrays compared leaf by leaf with `atol`/`rtol` (in float32).
    `smoke` marks the small shapes that `--cpu-smoke` runs in interpret mode.
    """

    op: str
    name: str
    make_inputs: Callable[[jax.Array], Sequence]
    pallas: Callable[[bool], Callable]
    reference: Callable[[], Callable]
    atol: float
    rtol: float
    smoke: bool = False


def max_error(a, b) -> float:
    errs = [
        float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)), initial=0.0))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return max(errs, default=0.0)


def allclose(a, b, atol: float, rtol: float) -> bool:
    return all(
        np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=atol, rtol=rtol)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def median_ms(fn: Callable, args: Sequence, *, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
