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
        y = jnp.dot(x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]
