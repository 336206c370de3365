"""Dense projection with an [in, out] kernel (HF's [out, in] weights are transposed at load)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Accumulate in f32 and round once: XLA:CPU's bf16-output dot is ~15x slower than this,
        # and it matches how torch computes bf16 matmuls.
        y = jnp.dot(x, self.kernel[...], preferred_element_type=jnp.float32).astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]
