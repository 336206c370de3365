"""Dense projection with an [in, out] kernel (HF's [out, in] weights are transposed at load)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import compute


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Inputs in the weights' dtype, accumulation in f32, one rounding to the activation dtype:
        # XLA:CPU's bf16-output dot is ~15x slower, and this is how torch computes bf16 matmuls.
        # Without native bf16 a prefill's operands are widened first (model/layers/compute.py).
        k = self.kernel[...]
        y = jnp.dot(*compute.dot_operands(x.astype(k.dtype), k), preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)
