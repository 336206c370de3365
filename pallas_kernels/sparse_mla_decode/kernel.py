"""Sparse MLA decode in Pallas (Triton lowering): gathered-row tiles, split index axis, base-2 combine.

Grid (token, head block, split). Each program walks its share of the index tiles (main pool, then
extra pool), gathers TILE cache rows by index vector inside the kernel, and keeps an online softmax in
base 2 with f32 value accumulators in 128-wide pieces. The QK dot is split into power-of-two parts:
the 128-wide value pieces (which are then reused as the values, so each gathered byte is loaded once)
plus the rope remainder (64 for D_qk 576). Shares of the index axis are balanced over the *actual*
lengths at run time, so short rows leave trailing splits idle (they write lse = -inf) rather than
unbalanced. The partials are merged by a jnp combine in base 2, which adds the sink once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import platform
from pallas_kernels.sparse_mla_decode import heuristics
from pallas_kernels.sparse_mla_decode.reference import check_args

LOG2E = math.log2(math.e)
VALUE_PIECE = 128


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parts(d_qk: int, d_v: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of each QK part: value pieces first, then the rope remainder's binary parts."""
    vw = min(VALUE_PIECE, d_v)
    parts = [(off, vw) for off in range(0, d_v, vw)]
    off, rest = d_v, d_qk - d_v
    while rest:
        w = 1 << (rest.bit_length() - 1)
        parts.append((off, w))
        off, rest = off + w, rest - w
    return tuple(parts)


def kernel_limits(d_qk: int, d_v: int) -> str | None:
    """Why the kernel cannot serve this head layout, or None."""
    vw = min(VALUE_PIECE, d_v)
    if vw < 16 or not _is_pow2(vw) or d_v % vw:
        return f"d_v {d_v} must be a power of two >= 16 or a multiple of {VALUE_PIECE}"
    if min(w for _, w in _parts(d_qk, d_v)) < 16:
        return f"rope part D_qk - d_v = {d_qk - d_v} must be a multiple of 16 (dots need K >= 16)"
    return None


def _attend(carry, q_parts, idx_ref, kv_ref, length, lo, hi, *, parts, n_values, nan_free, scale2):
    """Online softmax over tiles [lo, hi) of one pool; entries at or past `length` are invalid."""
    num_slots = kv_ref.shape[0]
    prec = jax.lax.Precision.HIGHEST if kv_ref.dtype == jnp.float32 else None

    def body(j, carry):
        m, denom, accs = carry
        pos = j * heuristics.TILE + jnp.arange(heuristics.TILE, dtype=jnp.int32)
        idx = plt.load(
            idx_ref.at[pl.ds(j * heuristics.TILE, heuristics.TILE)], mask=pos < length, other=-1
        )
        # Entries at or past `length` load as -1, so this one test guards the tail too.
        valid = (idx >= 0) & (idx < num_slots)
        rows = jnp.where(valid, idx, 0)[:, None]
        pieces = []
        for off, w in parts:
            where = (rows, off + jnp.arange(w, dtype=jnp.int32)[None, :])
            if nan_free:
                pieces.append(kv_ref[where])
            else:
                # The scrub: rows of invalid entries are never read, so their bytes cannot leak.
                mask = jnp.broadcast_to(valid[:, None], (heuristics.TILE, w))
                pieces.append(plt.load(kv_ref.at[where], mask=mask, other=0))
        s = None
        for qp, kp in zip(q_parts, pieces, strict=True):
            d = jax.lax.dot_general(
                qp, kp, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
            )
            s = d if s is None else s + d
        s = jnp.where(valid[None, :], s * scale2, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        denom = denom * alpha + jnp.sum(p, axis=1)
        pv = p.astype(kv_ref.dtype)
        accs = tuple(
            a * alpha[:, None] + jnp.dot(pv, v, precision=prec, preferred_element_type=jnp.float32)
            for a, v in zip(accs, pieces[:n_values], strict=True)
        )
        return m_new, denom, accs

    return jax.lax.fori_loop(lo, hi, body, carry)


def _kernel(*refs, parts, n_values, nan_free, scale2, has_extra, num_splits):
    if has_extra:
        q_ref, len_ref, idx_ref, kv_ref, elen_ref, eidx_ref, ekv_ref, o_ref, lse_ref = refs
    else:
        q_ref, len_ref, idx_ref, kv_ref, o_ref, lse_ref = refs
    tile = heuristics.TILE
    n_main = (len_ref[0] + tile - 1) // tile
    n_extra = (elen_ref[0] + tile - 1) // tile if has_extra else 0
    total = n_main + n_extra
    per = (total + num_splits - 1) // num_splits
    lo = pl.program_id(2) * per
    hi = jnp.minimum(lo + per, total)

    bh = q_ref.shape[0]
    q_parts = [q_ref[:, pl.ds(off, w)] for off, w in parts]
    vw = parts[0][1]
    carry = (
        jnp.full((bh,), -jnp.inf, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
        tuple(jnp.zeros((bh, vw), jnp.float32) for _ in range(n_values)),
    )
    attend = functools.partial(
        _attend, parts=parts, n_values=n_values, nan_free=nan_free, scale2=scale2
    )
    carry = attend(carry, q_parts, idx_ref, kv_ref, len_ref[0], lo, jnp.minimum(hi, n_main))
    if has_extra:
        carry = attend(
            carry,
            q_parts,
            eidx_ref,
            ekv_ref,
            elen_ref[0],
            jnp.maximum(lo, n_main) - n_main,
            hi - n_main,
        )
    m, denom, accs = carry
    seen = denom > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, denom, 1.0), 0.0)
    for c, a in enumerate(accs):
        o_ref[:, pl.ds(c * vw, vw)] = a * inv[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, denom, 1.0)), -jnp.inf)


def combine(o_parts, lse2_parts, sink):
    """Merge per-split (out, base-2 lse) into (out, natural-log sink-free lse); kernels.md B.4.

    o_parts: f32[T, S, H, d_v]; lse2_parts: f32[T, S, H], -inf for a split that saw nothing.
    """
    m = jnp.max(lse2_parts, axis=1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp2(lse2_parts - m[:, None]), axis=1)
    seen = total > 0
    lse2 = jnp.where(seen, m + jnp.log2(jnp.where(seen, total, 1.0)), jnp.inf)
    norm = lse2
    if sink is not None:
        sink2 = sink.astype(jnp.float32)[None, :] * LOG2E
        norm = jnp.where(seen, jnp.logaddexp2(lse2, sink2), sink2)
    w = jnp.exp2(lse2_parts - norm[:, None])
    out = jnp.sum(w[..., None] * o_parts, axis=1)
    return out, lse2 / LOG2E


def check_num_splits(num_splits) -> None:
    if num_splits == "auto":
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be 'auto' or a positive int, got {num_splits!r}")


def resolve_num_splits(num_splits, T, H, topk, extra_topk) -> int:
    check_num_splits(num_splits)
    if num_splits == "auto":
        return heuristics.num_splits(T, H, topk, platform.num_cores(), extra_topk=extra_topk)
    return num_splits


def _lengths(lengths, topk, T):
    if lengths is None:
        return jnp.full((T,), topk, jnp.int32)
    return jnp.clip(lengths, 0, topk).astype(jnp.int32)


def sparse_mla_decode(
    q,
    kv_cache,
    indices,
    *,
    sm_scale,
    d_v,
    topk_lengths=None,
    sink=None,
    extra_kv_cache=None,
    extra_indices=None,
    extra_topk_lengths=None,
    nan_free=False,
    num_splits="auto",
    interpret=False,
):
    """Same contract as reference.sparse_mla_decode; `num_splits` forces a split count."""
    check_args(
        q,
        kv_cache,
        indices,
        sm_scale=sm_scale,
        d_v=d_v,
        topk_lengths=topk_lengths,
        sink=sink,
        extra_kv_cache=extra_kv_cache,
        extra_indices=extra_indices,
        extra_topk_lengths=extra_topk_lengths,
    )
    T, H, D = q.shape
    reason = kernel_limits(D, d_v)
    if reason is not None:
        raise ValueError(f"sparse_mla_decode pallas kernel: {reason}")
    has_extra = extra_kv_cache is not None
    topk, etopk = indices.shape[1], extra_indices.shape[1] if has_extra else 0
    splits = resolve_num_splits(num_splits, T, H, topk, etopk)
    bh = heuristics.head_block(H)
    hp = -(-H // bh) * bh
    qp = jnp.pad(q, ((0, 0), (0, hp - H), (0, 0))) if hp != H else q

    row = pl.BlockSpec((1,), lambda t, h, s: (t,))
    args = [qp, _lengths(topk_lengths, topk, T), indices, kv_cache]
    specs = [
        pl.BlockSpec((None, bh, D), lambda t, h, s: (t, h, 0)),
        row,
        pl.BlockSpec((None, topk), lambda t, h, s: (t, 0)),
        pl.BlockSpec(kv_cache.shape, lambda t, h, s: (0, 0)),
    ]
    if has_extra:
        args += [_lengths(extra_topk_lengths, etopk, T), extra_indices, extra_kv_cache]
        specs += [
            row,
            pl.BlockSpec((None, etopk), lambda t, h, s: (t, 0)),
            pl.BlockSpec(extra_kv_cache.shape, lambda t, h, s: (0, 0)),
        ]
    parts = _parts(D, d_v)
    kernel = functools.partial(
        _kernel,
        parts=parts,
        n_values=d_v // parts[0][1],
        nan_free=nan_free,
        scale2=float(sm_scale) * LOG2E,
        has_extra=has_extra,
        num_splits=splits,
    )
    o_parts, lse2_parts = pl.pallas_call(
        kernel,
        grid=(T, hp // bh, splits),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, bh, d_v), lambda t, h, s: (t, s, h, 0)),
            pl.BlockSpec((None, None, bh), lambda t, h, s: (t, s, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((T, splits, hp, d_v), jnp.float32),
            jax.ShapeDtypeStruct((T, splits, hp), jnp.float32),
        ],
        compiler_params=platform.triton_params(num_warps=heuristics.num_warps(bh)),
        interpret=interpret,
    )(*args)
    out, lse = combine(o_parts[:, :, :H], lse2_parts[:, :, :H], sink)
    return out.astype(q.dtype), lse
