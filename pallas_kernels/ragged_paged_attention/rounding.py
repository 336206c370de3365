"""Where a bf16 (or f16) model's attention rounds on the jnp path: where HF's does on CPU torch.

HF's bf16 Llama attends through torch's CPU flash-attention kernel (sdpa). Its scores and sums are
f32, but the unnormalised probabilities exp(s - m) are rounded to the activation dtype before the
value product (accumulated in f32), and the output is that product over the f32 sum of the
unrounded exponentials. Keys go through in blocks of KEY_BLOCK, so m is the running maximum of the
row's scores over the blocks seen so far: a key in block b is rounded relative to the maximum over
blocks 0..b. Rounding the probabilities anywhere else (normalised, or relative to another
maximum) changes ~20% (normalised) or ~10% (128-key chunk maxima) of the bf16 attention outputs
against HF's, on a 335-token causal step; rounded as here, ~2% still differ by one bf16 ulp,
because torch's exponential is a fast approximation (`fexp_u20`: exp(0) = 1 - 5.3e-5, i.e. ~2^-14
relative error) whose values land on the other side of a bf16 rounding boundary (docs/architecture.md).

Float32 models are untouched: `rounds` is false for them and callers keep their f32 path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

KEY_BLOCK = 512  # torch's kv_split_size for every CPU flash-attention call


def rounds(dtype) -> bool:
    """Whether attention for queries of `dtype` rounds its probabilities (narrower than f32)."""
    return jnp.dtype(dtype).itemsize < 4


def run_maxima(s, width: int):
    """s [N, ..., L] -> [N, ..., L / width]: the maximum of each run of `width` keys."""
    *lead, length = s.shape
    return jnp.max(s.reshape(*lead, length // width, width), axis=-1)


def block_reference(run_max, k_pos, group, num_groups: int, num_keys: int, width: int):
    """Per run of `width` keys (`run_maxima` of N pieces' scores [N, ..., R]), the maximum of its
    row's scores over the KEY_BLOCK blocks up to and including its own: the keys of piece n lie
    at positions k_pos [N, R * width], pieces of the same rows share group[n] (a query tile or a
    sequence, of num_groups); num_keys bounds every position (static). -> [N, ..., R]."""
    n, runs = run_max.shape[0], run_max.shape[-1]
    rest = run_max.shape[1:-1]
    blocks = -(-num_keys // KEY_BLOCK)
    flat = jnp.moveaxis(run_max, -1, 1).reshape(n * runs, *rest)
    block = jnp.minimum(k_pos[:, ::width] // KEY_BLOCK, blocks - 1)  # [N, R]
    ids = (group[:, None] * blocks + block).reshape(-1)
    per_block = jax.ops.segment_max(flat, ids, num_segments=num_groups * blocks)
    running = jax.lax.cummax(per_block.reshape(num_groups, blocks, *rest), axis=1)
    ref = running.reshape(num_groups * blocks, *rest)[ids].reshape(n, runs, *rest)
    return jnp.moveaxis(ref, 1, -1)


@dataclass(frozen=True)
class Rounding:
    """HF's rounding for one step's pieces of rows (`block_reference`'s arguments) and the
    dtype the probabilities round to."""

    k_pos: jax.Array
    group: jax.Array
    num_groups: int
    num_keys: int
    dtype: object

    @property
    def width(self) -> int:
        """Keys in a run that lies inside one KEY_BLOCK block (pieces start at multiples of it)."""
        return math.gcd(self.k_pos.shape[1], KEY_BLOCK)

    def run_maxima(self, s):
        """Scaled scores s [n, ..., L] (-inf where not attended) -> their runs' maxima."""
        return run_maxima(s, self.width)

    def reference(self, run_max):
        """Every piece's run maxima [N, ..., R] -> each run's reference maximum [N, ..., R]."""
        args = (self.k_pos, self.group, self.num_groups, self.num_keys, self.width)
        return block_reference(run_max, *args)

    def expand(self, ref):
        """Per run [n, ..., R] -> per key [n, ..., L]."""
        return jnp.repeat(ref, self.width, axis=-1)

    def parts(self, s, mask):
        """(p, m, sum) of scaled scores s [N, ..., L] already -inf where mask is false."""
        ref = self.expand(self.reference(self.run_maxima(s)))
        return rounded_parts(s, mask, ref, self.dtype)


def for_pieces(dtype, k_pos, group, num_groups: int, num_keys: int) -> Rounding | None:
    """The Rounding of a step's pieces for queries of `dtype`; None for f32 (nothing rounds)."""
    if not rounds(dtype):
        return None
    return Rounding(k_pos, group, num_groups, num_keys, dtype)


def rounded_parts(s, mask, ref, dtype):
    """HF's rounding of one piece's softmax parts, from its scaled scores s [..., L], mask and
    per-key reference maxima ref (`Rounding.reference`, expanded): (p, m, sum) as decode.py's
    `softmax_parts` gives them, p rounded to `dtype` relative to ref and rescaled to the piece's
    largest reference m (a factor of 1 unless the piece spans blocks)."""
    m = jnp.max(ref, axis=-1)
    safe = jnp.where(jnp.isfinite(ref), ref, 0.0)
    e = jnp.where(mask, jnp.exp(s - safe), 0.0)
    shift = jnp.exp(safe - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    p = e.astype(dtype).astype(jnp.float32) * shift
    return p, m, jnp.sum(e * shift, axis=-1)
