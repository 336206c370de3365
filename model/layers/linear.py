"""Dense projection with an [out, in] weight, as HF stores it (loaded without a transpose).

The weight is contracted on its minor (input) axis. XLA:CPU's small-row dots run faster on
weights laid out so than on [in, out] kernels, and a decode step's dots are small-row: in one
process, the benchmark Llama's eight layers of projections (512 -> 768, 512 -> 512,
512 -> 2816, 1408 -> 512) took 7.7 against 8.8 ms at 8 rows, 10.3 against 12.8 at 16, 14.9
against 17.5 at 32 and the same from 64 rows up (2048 rows included); whole offline runs of
the benchmark workload, alternating in one process, 23.7 against 25.9 s (median of 3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import compute


def project(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] @ weight [out, in].T -> [..., out], accumulated in f32."""
    x = compute.for_weight(x, weight).astype(weight.dtype)
    x, weight = compute.dot_operands(x, weight)
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(x, weight, contract, preferred_element_type=jnp.float32)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        # f32 for a bf16 model where this host widens its weights once (model/layers/compute.py).
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), compute.weight_dtype(dtype)))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Inputs in the weights' dtype, accumulation in f32, one rounding to the activation dtype:
        # XLA:CPU's bf16-output dot is ~15x slower, and this is how torch computes bf16 matmuls.
        # Without native bf16 a prefill's operands are widened first (model/layers/compute.py).
        y = project(x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)
