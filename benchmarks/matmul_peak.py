"""The host's matmul peak, the denominator of every benchmark's MFU (model FLOPs / seconds / peak).

A benchmark whose MFU is near 1 is bound by the machine's matmul speed at that precision: no
change to the engine around the dots can raise its ratio much further. `ratio_at_peak` in the
benchmarks' JSON says how far: the ratio vlax would reach if it ran every model FLOP at this peak.
"""

from __future__ import annotations

import time


def peak_flops(dtype: str) -> float:
    """The fastest 2048^3 matmul of `dtype` values this host's XLA:CPU runs, accumulating in f32
    as the model's dots do: operands in `dtype`, or (narrower dtypes) widened to f32 first, the
    two ways vlax computes a bf16 dot (model/layers/compute.py). A `dtype`-output dot is not a
    candidate: with AMX it ran at 281 GFLOP/s where the f32-accumulating one ran at 1778, so a
    peak taken from it would credit the model with more than the machine's utilisation."""
    import jax
    import jax.numpy as jnp

    n = 2048
    best = float("inf")
    for operands in dict.fromkeys((dtype, "float32")):
        a = (jnp.ones((n, n), dtype) * 0.01).astype(operands)
        f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        f(a, a).block_until_ready()
        for _ in range(5):
            t0 = time.perf_counter()
            f(a, a).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
