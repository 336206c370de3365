"""The Pallas KDA decode kernel (interpret mode, under jit): prefill n tokens, decode m more from
the state pool, and the result equals one prefill of n + m tokens; padding rows and unreferenced
slots stay untouched; every v_split gives the same bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_inputs import prefill_inputs

from pallas_kernels.kda import kernel
from pallas_kernels.kda.reference import kda_recurrent_reference

PREFIX = (5, 0, 17, 33)  # tokens prefilled per sequence (one sequence starts empty)
STEPS = 3  # decode steps after the prefill
SLOTS = np.array([4, 0, 6, 2])  # pool slot of each sequence; slots 1, 3, 5 are never referenced
POOL = 7
IDX = np.array([4, -1, 0, 6, -1, 2], np.int32)  # decode rows, -1 = padding
ROW_SEQ = np.array([0, -1, 1, 2, -1, 3])
T = 80
# (H, HV, K, V, input dtype, which prefill provides the states)
GROUPS = (
    (2, 4, 128, 128, jnp.bfloat16, "reference"),
    (8, 8, 32, 64, jnp.float32, "kernel"),
)
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


def _pack(full, lens_full, keep):
    """The first keep[i] tokens of each sequence of `full`, packed and NaN-padded to T tokens."""
    starts = np.concatenate([[0], np.cumsum(lens_full)])
    idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts[:-1], keep, strict=True)])
    out = []
    for x in full:
        pad = jnp.full((T - idx.size,) + x.shape[1:], jnp.nan, x.dtype)
        out.append(jnp.concatenate([x[idx], pad]))
    return out


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"H{g[0]}-HV{g[1]}-K{g[2]}-V{g[3]}")
def test_prefill_then_decode_equals_longer_prefill(group):
    h, hv, kd, vd, dtype, prefill_impl = group
    scale = kd**-0.5
    rng = np.random.default_rng(kd + vd + h)
    lens_full = np.array(PREFIX) + STEPS
    q, k, v, g, beta, cu_full, s0 = prefill_inputs(rng, lens_full, T, h, hv, kd, vd, dtype=dtype)
    if prefill_impl == "kernel":
        prefill = jax.jit(lambda *a: kernel.kda_prefill(*a, scale=scale, v_split=1, interpret=True))
    else:
        prefill = jax.jit(lambda *a: kda_recurrent_reference(*a, scale=scale))
    o_full, s_full = prefill(q, k, v, g, beta, cu_full, s0)
    part = _pack((q, k, v, g, beta), lens_full, PREFIX)
    cu_part = jnp.asarray(np.concatenate([[0], np.cumsum(PREFIX)]), jnp.int32)
    _, s_part = prefill(*part, cu_part, s0)

    pool0 = np.full((POOL, hv, vd, kd), np.nan, np.float32)
    pool0[SLOTS] = np.asarray(s_part)
    live = ROW_SEQ >= 0
    results = {}
    for split in (1, 2, 4):
        decode = jax.jit(
            lambda *a, s=split: kernel.kda_decode(*a, scale=scale, v_split=s, interpret=True)
        )
        pool, outs = jnp.asarray(pool0), []
        for j in range(STEPS):
            tok = np.asarray(cu_full)[:-1] + np.array(PREFIX) + j
            rows = np.where(live, tok[np.maximum(ROW_SEQ, 0)], T - 1)  # T - 1 is a NaN token
            o, pool = decode(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, jnp.asarray(IDX))
            outs.append(np.asarray(o))
            ref = np.asarray(o_full[tok], np.float32)
            np.testing.assert_allclose(outs[-1][live].astype(np.float32), ref, atol=TOL[dtype],
                                       rtol=TOL[dtype], err_msg=f"step {j} v_split={split}")  # fmt: skip
            assert not outs[-1][~live].astype(np.float32).any(), "padding rows must output zeros"
        results[split] = (np.stack(outs), np.asarray(pool))
    outs, pool = results[1]
    np.testing.assert_allclose(pool[SLOTS], s_full, atol=2e-4, rtol=1e-4)
    never = np.setdiff1d(np.arange(POOL), SLOTS)
    assert np.isnan(pool[never]).all(), "unreferenced pool slots were written"
    for split in (2, 4):
        assert np.array_equal(outs, results[split][0]), f"v_split={split} outputs differ"
        assert np.array_equal(pool, results[split][1], equal_nan=True), f"v_split={split} pool"

    # One live row: only its slot changes; the other sequences' slots keep their exact bits.
    one = np.full_like(IDX, -1)
    one[3] = IDX[3]
    rows = np.full(IDX.shape, T - 1)
    rows[3] = 0
    _, after = decode(q[rows], k[rows], v[rows], g[rows], beta[rows], jnp.asarray(pool),
                      jnp.asarray(one))  # fmt: skip
    after = np.asarray(after)
    others = np.setdiff1d(np.arange(POOL), [IDX[3]])
    assert np.array_equal(after[others], pool[others], equal_nan=True)
    assert not np.array_equal(after[IDX[3]], pool[IDX[3]])
