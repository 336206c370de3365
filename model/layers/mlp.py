"""Gated MLP (SwiGLU, or GeGLU for Gemma) with the gate and up projections fused into one matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import compute
from model.layers.linear import Linear
from model.sharding import group_size, split_fused

# The gate activations served, by HF's hidden_act name.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, bias: bool, dtype, act: str = "silu"):
        if act not in ACTIVATIONS:
            raise ValueError(
                f"gated MLP activation {act!r} not served; served: {sorted(ACTIVATIONS)}"
            )
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, bias=bias, dtype=dtype)
        self.intermediate = intermediate
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        # Rows are independent: computed in parts where the [rows, 2 * intermediate] activation
        # would outgrow the CPU's cache (compute.row_parts), each part's output the same.
        parts = compute.row_parts(x.shape[0], 2 * self.intermediate * x.dtype.itemsize)
        if len(parts) == 1:
            return self._rows(x)
        return jnp.concatenate([self._rows(x[start:stop]) for start, stop in parts])

    def _rows(self, x: jax.Array) -> jax.Array:
        # Under tensor parallelism the fused columns are laid out per device (model/sharding.py).
        n = self.intermediate
        gate, up = split_fused(self.gate_up_proj(x), (n, n), group_size())
        return self.down_proj(gated(gate, up, self.act))


def gated(gate: jax.Array, up: jax.Array, act: str = "silu") -> jax.Array:
    """act(gate) * up in gate's dtype, rounded where HF rounds (the activation, then the
    product), the activation computed in f32 (compute.in_f32); GatedMLP's and the MoE experts'."""
    activated = ACTIVATIONS[act](compute.in_f32(gate)).astype(gate.dtype)
    return (compute.operand(activated) * compute.operand(up)).astype(gate.dtype)
