"""SwiGLU MLP with the gate and up projections fused into one matmul."""

from __future__ import annotations

import jax
from flax import nnx

from model.layers.linear import Linear


class GatedMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, bias: bool, dtype):
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, bias=bias, dtype=dtype)
        self.intermediate = intermediate

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
        return self.down_proj(jax.nn.silu(gate) * up)
