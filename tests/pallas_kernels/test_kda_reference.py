"""KDA oracles: the chunked WY/UT reference against the per-token recurrence, and the gate forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_inputs import prefill_inputs

from pallas_kernels.kda import kda_beta, kda_gate
from pallas_kernels.kda.reference import (
    kda_chunk_reference,
    kda_decode_reference,
    kda_recurrent_reference,
)

LENS = (0, 1, 0, 17, 0, 40, 64)
T, H, HV, K, V = 150, 2, 4, 32, 16


# jitted once per module: every test below reuses these compilations
REC = jax.jit(lambda *a: kda_recurrent_reference(*a, scale=K**-0.5))
CHUNK = {
    c: jax.jit(lambda *a, c=c: kda_chunk_reference(*a, scale=K**-0.5, chunk_size=c))
    for c in (16, 64)
}


def test_chunk_matches_recurrence_for_every_gate_form():
    rng = np.random.default_rng(0)
    for form, init in (("default", True), ("bounded", False), ("near0", True)):
        args = prefill_inputs(rng, LENS, T, H, HV, K, V, dtype=jnp.float32, form=form, init=init)
        o_rec, s_rec = REC(*args)
        assert np.isfinite(o_rec).all() and np.isfinite(s_rec).all()
        assert not np.asarray(o_rec[sum(LENS) :]).any(), "padding tokens must output zeros"
        for c, chk in CHUNK.items():
            o, s = chk(*args)
            np.testing.assert_allclose(o, o_rec, atol=2e-5, rtol=1e-5, err_msg=f"{form} C={c}")
            np.testing.assert_allclose(s, s_rec, atol=5e-5, rtol=1e-5, err_msg=f"{form} C={c}")
        empty = np.array([i for i, n in enumerate(LENS) if n == 0])
        np.testing.assert_array_equal(s_rec[empty], args[-1][empty])


def test_extreme_gates_stay_finite_and_agree():
    """g = -20 on every channel of every step (decay e^-20) and g = 0 (no decay at all)."""
    rng = np.random.default_rng(1)
    q, k, v, g, beta, cu, s0 = prefill_inputs(rng, LENS, T, H, HV, K, V, dtype=jnp.float32)
    for val in (-20.0, 0.0):
        gx = jnp.where(jnp.isnan(g), g, val)
        o_rec, s_rec = REC(q, k, v, gx, beta, cu, s0)
        o, s = CHUNK[64](q, k, v, gx, beta, cu, s0)
        assert np.isfinite(o).all() and np.isfinite(s).all()
        np.testing.assert_allclose(o, o_rec, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_rec, atol=5e-5, rtol=1e-5)


def test_decode_reference_is_one_recurrent_step():
    """Prefill all but the last token of each sequence, decode the last: equals the full prefill."""
    rng = np.random.default_rng(2)
    q, k, v, g, beta, cu, s0 = prefill_inputs(rng, LENS, T, H, HV, K, V, dtype=jnp.float32)
    o_full, s_full = REC(q, k, v, g, beta, cu, s0)
    live = np.array([i for i, n in enumerate(LENS) if n > 0])
    last = np.asarray(cu[1:])[live] - 1
    head = np.zeros(T, bool)
    head[: sum(LENS)] = True
    head[last] = False
    # the held-back tokens become NaN padding of the shortened prefill (cu_seqlens shifted)
    cut = [
        jnp.where(head.reshape((T,) + (1,) * (x.ndim - 1)), x, jnp.nan) for x in (q, k, v, g, beta)
    ]
    order = np.argsort(~head, kind="stable")
    cut = [x[order] for x in cut]
    lens_cut = np.array([max(n - 1, 0) for n in LENS])
    cu_cut = jnp.asarray(np.concatenate([[0], np.cumsum(lens_cut)]), jnp.int32)
    _, s_cut = REC(*cut, cu_cut, s0)
    slots = np.array([5, 0, 9, 2])[: len(live)]
    pool = jnp.full((11, HV, V, K), jnp.nan).at[slots].set(s_cut[live])
    idx = jnp.asarray(np.insert(slots, 1, -1), jnp.int32)  # row 1 is padding
    rows = np.insert(last, 1, 0)
    dec = jax.jit(lambda *a: kda_decode_reference(*a, scale=K**-0.5))
    o, new_pool = dec(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, idx)
    np.testing.assert_allclose(np.delete(o, 1, 0), o_full[last], atol=2e-5, rtol=1e-5)
    assert not np.asarray(o[1]).any()
    np.testing.assert_allclose(new_pool[slots], s_full[live], atol=5e-5, rtol=1e-5)
    untouched = np.setdiff1d(np.arange(11), slots)
    assert np.isnan(new_pool[untouched]).all()


def test_gate_forms_and_ranges():
    rng = np.random.default_rng(3)
    raw = jnp.asarray(rng.normal(0, 3, (64, 2, 8)), jnp.float32)
    a_log = jnp.asarray([0.5, -1.0], jnp.float32)
    bias = jnp.asarray(rng.normal(0, 1, 16), jnp.float32)
    x = raw + bias.reshape(2, 8)
    g = kda_gate(raw, a_log, bias)
    np.testing.assert_allclose(g, -jnp.exp(a_log)[:, None] * jax.nn.softplus(x), rtol=1e-6)
    assert (np.asarray(g) <= 0).all() and float(g.min()) < -5.0
    gb = kda_gate(raw, a_log, bias, lower_bound=-5.0)
    np.testing.assert_allclose(gb, -5.0 * jax.nn.sigmoid(jnp.exp(a_log)[:, None] * x), rtol=1e-6)
    assert (np.asarray(gb) >= -5.0).all() and (np.asarray(gb) <= 0).all()
    b = kda_beta(jnp.asarray(rng.normal(0, 3, (64, 2)), jnp.bfloat16))
    assert b.dtype == jnp.float32 and (np.asarray(b) > 0).all() and (np.asarray(b) < 1).all()
    with pytest.raises(ValueError, match="lower_bound must lie in"):
        kda_gate(raw, a_log, bias, lower_bound=-6.0)
    with pytest.raises(ValueError, match="A_log must be"):
        kda_gate(raw, a_log[:1], bias)


def test_bad_shapes_are_named():
    rng = np.random.default_rng(4)
    q, k, v, g, beta, cu, s0 = prefill_inputs(rng, (3,), 3, 2, 2, 16, 16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="multiple of q/k heads"):
        kda_recurrent_reference(q, k, v[:, :1].repeat(3, 1), g[:, :1].repeat(3, 1),
                                beta[:, :1].repeat(3, 1), cu, None, scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        kda_chunk_reference(q, k, v, g, beta, cu.astype(jnp.float32), s0, scale=1.0)
    with pytest.raises(ValueError, match="initial_state must be"):
        kda_chunk_reference(q, k, v, g, beta, cu, s0[:, :, :8], scale=1.0)
