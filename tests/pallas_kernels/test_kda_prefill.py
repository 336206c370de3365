"""The Pallas KDA prefill kernel (interpret mode, under jit) against the per-token recurrence.

Each shape group compiles once per v_split: every batch of a group is padded to the same T and N
(NaN padding tokens, zero-length sequences), so the varlen layouts differ only in values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_inputs import prefill_inputs

from pallas_kernels.kda import kernel
from pallas_kernels.kda.reference import kda_recurrent_reference

SHORT = ((0, 1, 0, 17, 0), (64, 65, 200, 0, 0))
LONG = SHORT + ((1000, 0, 0, 0, 0),)
FORMS = ("default", "bounded", "near0")
# (H, HV, K, V, input dtype, T): HV = 2H and HV = H, K = V = 128 (f32, with the 1000-token
# sequence at full width) and a small config (bf16 and f32). bf16 at K = V = 128 is covered by
# test_kda_decode.py; each group costs about three interpret-mode compilations (one per v_split).
GROUPS = (
    (2, 4, 128, 128, jnp.float32, 1000),
    (1, 1, 32, 64, jnp.bfloat16, 335),
    (8, 16, 32, 64, jnp.float32, 335),
)
TOL = {jnp.float32: (1e-4, 1e-4), jnp.bfloat16: (3e-2, 2e-2)}


def _kernel_fn(k_dim, v_split):
    return jax.jit(
        lambda *a: kernel.kda_prefill(*a, scale=k_dim**-0.5, v_split=v_split, interpret=True)
    )


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"H{g[0]}-HV{g[1]}-K{g[2]}-V{g[3]}")
def test_prefill_matches_recurrence_and_v_split_is_exact(group):
    h, hv, kd, vd, dtype, t = group
    rng = np.random.default_rng(hv * kd + vd)
    ref = jax.jit(lambda *a: kda_recurrent_reference(*a, scale=kd**-0.5))
    fns = {s: _kernel_fn(kd, s) for s in (1, 2, 4)}
    atol, rtol = TOL[dtype]
    for i, lens in enumerate(LONG if t >= 1000 else SHORT):
        args = prefill_inputs(
            rng, lens, t, h, hv, kd, vd, dtype=dtype, form=FORMS[i % 3], init=i % 2 == 0
        )
        o_ref, s_ref = ref(*args)
        o1, s1 = (np.asarray(x) for x in fns[1](*args))
        assert o1.dtype == dtype and s1.dtype == np.float32
        assert np.isfinite(o1.astype(np.float32)).all() and np.isfinite(s1).all(), lens
        assert not o1[sum(lens) :].astype(np.float32).any(), "padding tokens must output zeros"
        where = f"lens={lens} group={group}"
        np.testing.assert_allclose(o1.astype(np.float32), np.asarray(o_ref, np.float32),
                                   atol=atol, rtol=rtol, err_msg=where)  # fmt: skip
        np.testing.assert_allclose(s1, s_ref, atol=2e-4, rtol=1e-4, err_msg=where)
        empty = np.array([j for j, n in enumerate(lens) if n == 0])
        np.testing.assert_array_equal(s1[empty], np.asarray(args[-1])[empty])
        for split in (2, 4):
            o_s, s_s = fns[split](*args)
            assert np.array_equal(o1, np.asarray(o_s)), f"v_split={split} output differs, {where}"
            assert np.array_equal(s1, np.asarray(s_s)), f"v_split={split} state differs, {where}"


def test_prefill_without_initial_state_and_chunk_64():
    """None means zero states; the largest chunk size agrees with the recurrence too."""
    rng = np.random.default_rng(7)
    lens, t, h, hv, kd, vd = (0, 1, 0, 17, 0, 90), 120, 1, 2, 16, 16
    args = prefill_inputs(rng, lens, t, h, hv, kd, vd, dtype=jnp.float32, init=False)
    o_ref, s_ref = kda_recurrent_reference(*args, scale=0.25)
    f = jax.jit(lambda *a: kernel.kda_prefill(*a, None, scale=0.25, chunk_size=64, interpret=True))
    o, s = f(*args[:-1])
    np.testing.assert_allclose(o, o_ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(s, s_ref, atol=2e-4, rtol=1e-4)


def test_prefill_rejects_what_it_cannot_serve():
    rng = np.random.default_rng(8)
    args = prefill_inputs(rng, (3,), 3, 1, 1, 32, 32, dtype=jnp.float32)
    with pytest.raises(ValueError, match="v_split 4 leaves slices of 32/4"):
        kernel.kda_prefill(*args, scale=1.0, v_split=4, interpret=True)
    with pytest.raises(ValueError, match="chunk_size must be one of"):
        kernel.kda_prefill(*args, scale=1.0, chunk_size=8, interpret=True)
    wide = prefill_inputs(rng, (3,), 3, 1, 1, 48, 32, dtype=jnp.float32)
    with pytest.raises(ValueError, match="K=48 must be a power of two"):
        kernel.kda_prefill(*wide, scale=1.0, interpret=True)


def test_a_later_nan_never_reaches_earlier_tokens_of_its_chunk():
    """The scenario that used to break: a chunk's triangular products give a later token a 0
    weight in an earlier token's output, but 0 * NaN is NaN, so one non-finite k, g, beta or v
    made its whole chunk NaN (tokens before it included). Now the kernel and the chunked
    reference put NaN exactly where the per-token recurrence does: from that token on, in every
    value column for k / g / beta, in its own column for v (a NaN q stays in its own row)."""
    from pallas_kernels.kda.reference import kda_chunk_reference

    rng = np.random.default_rng(9)
    lens, t, h, hv, kd, vd = (20, 30, 5), 64, 1, 2, 16, 32
    q, k, v, g, beta, cu, s0 = prefill_inputs(rng, lens, t, h, hv, kd, vd, dtype=jnp.float32)
    v = v.at[10, 0, 3].set(jnp.nan)  # sequence 0: column 3 of value head 0 from token 10 on
    k = k.at[13, 0, 5].set(jnp.inf)  # sequence 0: everything from token 13 on
    q = q.at[25, 0, 1].set(jnp.nan)  # sequence 1: token 25 only
    g = g.at[45, 1, 2].set(jnp.nan)  # sequence 1: value head 1 from token 45 on
    beta = beta.at[52, 0].set(jnp.inf)  # sequence 2: value head 0 from token 52 on
    args = (q, k, v, g, beta, cu, s0)
    want_o, want_s = (np.asarray(x) for x in kda_recurrent_reference(*args, scale=0.25))
    assert np.isfinite(want_o[:10]).all() and np.isfinite(want_o[[26, 44, 51]]).all()
    runs = {
        "kernel": jax.jit(lambda *a: kernel.kda_prefill(*a, scale=0.25, interpret=True)),
        "chunk reference": jax.jit(lambda *a: kda_chunk_reference(*a, scale=0.25, chunk_size=16)),
    }
    for name, fn in runs.items():
        o, s = (np.asarray(x) for x in fn(*args))
        np.testing.assert_array_equal(np.isnan(o), np.isnan(want_o), err_msg=name)
        np.testing.assert_array_equal(np.isnan(s), np.isnan(want_s), err_msg=name)
        np.testing.assert_allclose(o, want_o, atol=1e-4, rtol=1e-4, err_msg=name)
