"""Kimi Delta Attention (KDA) layer over a ragged batch, its state kept in per-request slots.

Parameter names and math follow HF's `KimiLinearDeltaAttention` (shared/reference/kernels.md A):
q, k, v projections each through a short causal conv (model/layers/short_conv.py) and SiLU; the
per-channel log decay g from f_a_proj -> f_b_proj with A_log and dt_bias (`kda_gate`, bounded by
`gate_lower_bound` when the config sets one); beta = sigmoid(b_proj x); the delta-rule recurrence
with l2-normalised q and k at scale head_dim ** -0.5; then o_norm (an RMSNorm per head, times
sigmoid of the g_a_proj -> g_b_proj gate) and o_proj.

State. Each layer keeps, per state slot, the recurrent state [H, V, K] (float32, V-first as the
kernels want) and the conv tail [W-1, 3 * H * K] (the last W-1 q/k/v inputs). A batch row reads and
writes the slot `batch.state_slots` names; `batch.state_reset` zeroes the slot first (its request
starts here). Rows with one token run `kda_decode` on the pooled state by slot; rows with more run
`kda_prefill` varlen from their slot's state, and their final states are written back. A step with
no row longer than one token skips the prefill call (`lax.cond`), so pure decode steps pay for
`kda_decode` only. Padding rows (past `batch.num_seqs`) touch no slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from model.batch import ModelBatch
from model.layers.linear import Linear
from model.layers.short_conv import short_conv, token_rows
from pallas_kernels.backends import Choice
from pallas_kernels.kda import kda_beta, kda_decode, kda_gate, kda_prefill


@dataclasses.dataclass(frozen=True, slots=True)
class KDAShape:
    """The sizes of one KDA layer (Kimi: q/k and v share heads and head dim)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_size: int  # the short conv's width W
    gate_lower_bound: float | None  # None: the unbounded default gate
    norm_eps: float

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return 3 * self.proj_dim  # q, k and v, in that order


class KimiDeltaAttention(nnx.Module):
    """One KDA layer; `prefill` / `decode` are the kda_prefill and kda_decode backend choices."""

    def __init__(
        self,
        shape: KDAShape,
        dtype,
        *,
        prefill: Choice,
        decode: Choice,
        interpret: bool | None = None,
    ):
        s = shape
        self.shape = s
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.interpret = interpret
        d, h, k = s.hidden_size, s.num_heads, s.head_dim
        # One matmul for every projection of the layer's input: q, k, v (conv inputs), then
        # f_a (gate), g_a (output gate) and b (beta).
        self.in_proj = Linear(d, 3 * h * k + 2 * k + h, bias=False, dtype=dtype)
        # Depthwise conv kernels [W, 1, 3 * H * K] (HF's q/k/v_conv1d [H * K, 1, W], joined).
        self.conv_weight = nnx.Param(jnp.zeros((s.conv_size, 1, s.conv_channels), dtype))
        self.f_b_proj = Linear(k, h * k, bias=False, dtype=dtype)
        self.A_log = nnx.Param(jnp.zeros((1, 1, h, 1), dtype))
        self.dt_bias = nnx.Param(jnp.zeros((h * k,), jnp.float32))  # HF keeps it in float32
        self.g_b_proj = Linear(k, h * k, bias=False, dtype=dtype)
        self.o_norm = nnx.Param(jnp.ones((k,), dtype))
        self.o_proj = Linear(h * k, d, bias=False, dtype=dtype)

    def __call__(
        self, x: jax.Array, state: tuple[jax.Array, jax.Array], batch: ModelBatch
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [T, hidden] (after input_layernorm) -> (out [T, hidden], (recurrent, conv) pools).

        `state` is this layer's (recurrent [P, H, V, K] float32, conv [P, W-1, 3 * H * K]) pools,
        P = state slots + 1 (the last one the padding rows' scratch slot).
        """
        s = self.shape
        t = x.shape[0]
        h, k = s.num_heads, s.head_dim
        if batch.state_slots is None or batch.state_reset is None:
            raise ValueError(
                "KDA layers need ModelBatch.state_slots and state_reset (the runner fills them "
                "for models with state cache specs); got None"
            )
        recurrent, conv = state
        num_rows = batch.cu_q_lens.shape[0] - 1
        rows = jnp.arange(num_rows, dtype=jnp.int32)
        live = rows < batch.num_seqs
        slots = batch.state_slots.astype(jnp.int32)
        # A slot whose new owner starts this step is zeroed before anything reads it.
        fresh = jnp.where(live & batch.state_reset, slots, recurrent.shape[0])
        recurrent = recurrent.at[fresh].set(0.0, mode="drop")
        conv = conv.at[fresh].set(jnp.zeros((), conv.dtype), mode="drop")

        proj = self.in_proj(x)
        c = s.conv_channels
        mixed, f_a, g_a, b = jnp.split(proj, (c, c + k, c + 2 * k), axis=-1)
        tails = conv[jnp.where(live, slots, conv.shape[0] - 1)]
        mixed, tails = short_conv(mixed, self.conv_weight[...][:, 0], tails, batch.cu_q_lens)
        conv = conv.at[jnp.where(live, slots, conv.shape[0])].set(tails, mode="drop")
        # SiLU in float32, rounded once (as torch computes it on bf16).
        mixed = jax.nn.silu(mixed.astype(jnp.float32)).astype(x.dtype)
        q, kk, v = (a.reshape(t, h, k) for a in jnp.split(mixed, 3, axis=-1))
        g = kda_gate(
            self.f_b_proj(f_a).reshape(t, h, k),
            self.A_log[...].reshape(h),
            self.dt_bias[...],
            lower_bound=s.gate_lower_bound,
        )
        beta = kda_beta(b)

        o, recurrent = self._attend(q, kk, v, g, beta, recurrent, slots, live, batch)
        gate = self.g_b_proj(g_a).reshape(t, h, k)
        o = _gated_rms_norm(o, gate, self.o_norm[...], s.norm_eps).astype(x.dtype)
        return self.o_proj(o.reshape(t, h * k)), (recurrent, conv)

    def _attend(self, q, k, v, g, beta, pool, slots, live, batch: ModelBatch):
        """(o [T, H, V], pool): one-token rows by kda_decode, longer rows by kda_prefill."""
        t = q.shape[0]
        cu = batch.cu_q_lens
        lens = cu[1:] - cu[:-1]
        decode_rows = live & (lens == 1)
        prefill_rows = live & (lens > 1)
        scale = self.shape.head_dim**-0.5

        first = jnp.minimum(cu[:-1], t - 1)  # a decode row's one token
        o_decode, pool = kda_decode(
            q[first], k[first], v[first], g[first], beta[first], pool,
            jnp.where(decode_rows, slots, -1),
            scale=scale, impl=self.decode_backend, interpret=self.interpret,
        )  # fmt: skip

        def prefill(pool):
            start = pool[jnp.where(prefill_rows, slots, pool.shape[0] - 1)]
            o, final = kda_prefill(
                q, k, v, g, beta, cu, start,
                scale=scale, impl=self.prefill_backend, interpret=self.interpret,
            )  # fmt: skip
            keep = jnp.where(prefill_rows, slots, pool.shape[0])
            return o, pool.at[keep].set(final.astype(pool.dtype), mode="drop")

        def no_prefill(pool):
            return jnp.zeros(v.shape, v.dtype), pool

        o_prefill, pool = jax.lax.cond(jnp.any(prefill_rows), prefill, no_prefill, pool)
        row, offset = token_rows(cu, t)
        from_decode = (decode_rows[row] & (offset == 0))[:, None, None]
        return jnp.where(from_decode, o_decode[row], o_prefill), pool


def _gated_rms_norm(o, gate, weight, eps):
    """HF's KimiLinearRMSNormGated in float32: RMSNorm over each head's V channels, times
    sigmoid(gate)."""
    of = o.astype(jnp.float32)
    of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    return of * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
