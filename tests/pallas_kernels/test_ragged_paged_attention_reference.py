"""The jnp reference (the CPU default path) against a per-token numpy loop, and write_kv."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import make_batch, numpy_attention

from pallas_kernels import backends
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, select, write_kv

CASES = [
    # q_lens, kv_lens, hq, hkv, sliding_window, soft_cap, pad_tokens, pad_seqs
    ([1, 7, 16, 100], [5, 40, 16, 130], 4, 1, None, None, 3, 2),
    ([1, 1, 1, 1], [33, 17, 2, 1], 8, 1, 8, 30.0, 0, 1),
    ([100], [100], 4, 4, None, None, 5, 0),
    ([7, 1], [7, 61], 8, 2, 20, None, 1, 0),
    ([16, 1, 7], [47, 3, 7], 4, 4, None, 5.0, 0, 3),
]


def test_reference_matches_per_token_loop():
    rng = np.random.default_rng(0)
    for ql, kl, hq, hkv, sw, sc, pt, ps in CASES:
        b = make_batch(
            rng,
            ql,
            kl,
            hq=hq,
            hkv=hkv,
            d=16,
            block_size=16,
            max_blocks=10,
            pad_tokens=pt,
            pad_seqs=ps,
        )
        f = jax.jit(
            lambda b, sw=sw, sc=sc: ragged_paged_attention(
                **b, sm_scale=0.25, sliding_window=sw, soft_cap=sc
            )
        )
        out = np.asarray(f({k: jnp.asarray(v) for k, v in b.items()}))
        want = numpy_attention(b, sm_scale=0.25, sliding_window=sw, soft_cap=sc)
        assert np.isfinite(out).all(), (ql, kl)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=f"{ql} {kl}")
        assert (out[sum(ql) :] == 0).all()


def test_reference_bf16_close_to_f32():
    rng = np.random.default_rng(1)
    b = make_batch(rng, [1, 7, 16], [9, 30, 20], hq=4, hkv=2, d=32, block_size=8, max_blocks=4)
    want = numpy_attention(b, sm_scale=0.2)
    bb = {k: jnp.asarray(v) for k, v in b.items()}
    for name in ("q", "k_cache", "v_cache"):
        bb[name] = bb[name].astype(jnp.bfloat16)
    out = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.2))(bb)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2, rtol=3e-2)


def test_cpu_default_is_reference():
    q = jnp.zeros((4, 8, 128), jnp.bfloat16)
    kc = jnp.zeros((2, 16, 2, 128), jnp.bfloat16)

    c = select(q, kc, platform="cpu")
    assert c.impl == "reference" and not c.interpret
    assert backends.select("ragged_paged_attention", platform="cpu").impl == "reference"


def test_bad_shapes_raise_clear_errors():
    q = jnp.ones((4, 6, 16))
    kc = jnp.ones((2, 16, 4, 16))
    args = (jnp.ones(2, jnp.int32), jnp.ones((2, 3), jnp.int32), jnp.ones(3, jnp.int32), 2)
    with pytest.raises(ValueError, match="q heads 6 not a multiple of kv heads 4"):
        ragged_paged_attention(q, kc, kc, *args, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"cu_q_lens \(2,\)"):
        ragged_paged_attention(
            jnp.ones((4, 8, 16)), kc, kc, args[0], args[1], args[0], 2, sm_scale=1.0
        )
    with pytest.raises(ValueError, match="num_kv_splits must be 'auto' or an int >= 1, got 0"):
        ragged_paged_attention(jnp.ones((4, 8, 16)), kc, kc, *args, sm_scale=1.0, num_kv_splits=0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        ragged_paged_attention(jnp.ones((4, 8, 16)), kc, kc, *args, sm_scale=1.0, sliding_window=0)


def test_write_kv_scatters_and_skips_minus_one():
    rng = np.random.default_rng(2)
    nb, bs, hkv, d = 5, 4, 2, 8
    kc0 = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    vc0 = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    k = rng.standard_normal((6, hkv, d)).astype(np.float32)
    v = rng.standard_normal((6, hkv, d)).astype(np.float32)
    slots = np.array([3, -1, 17, 0, -1, 19], np.int32)
    kc, vc = write_kv(
        jnp.asarray(kc0), jnp.asarray(vc0), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)
    )
    want_k, want_v = kc0.reshape(-1, hkv, d).copy(), vc0.reshape(-1, hkv, d).copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s], want_v[s] = k[i], v[i]
    np.testing.assert_array_equal(np.asarray(kc).reshape(-1, hkv, d), want_k)
    np.testing.assert_array_equal(np.asarray(vc).reshape(-1, hkv, d), want_v)


def test_write_kv_casts_to_cache_dtype_and_checks_shapes():
    kc = jnp.zeros((2, 4, 1, 8), jnp.bfloat16)
    k = jnp.full((2, 1, 8), 1.5, jnp.float32)
    out_k, _ = write_kv(kc, jnp.zeros_like(kc), k, k, jnp.array([5, -1], jnp.int32))
    assert out_k.dtype == jnp.bfloat16 and float(out_k[1, 1, 0, 0]) == 1.5
    assert float(jnp.abs(out_k.astype(jnp.float32)).sum()) == 1.5 * 8
    with pytest.raises(ValueError, match="expected k, v"):
        write_kv(
            jnp.zeros((2, 4, 1, 8)),
            jnp.zeros((2, 4, 1, 8)),
            jnp.zeros((2, 2, 8)),
            jnp.zeros((2, 2, 8)),
            jnp.array([0, 1]),
        )
