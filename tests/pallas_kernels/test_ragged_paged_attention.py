"""The Pallas ragged paged-attention kernel against the jnp reference (interpret mode), its lowering
for CUDA and ROCm, the split heuristic and the backend selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import make_batch

from pallas_kernels import backends
from pallas_kernels.backends import BackendError
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, select
from pallas_kernels.ragged_paged_attention import reference as ref
from pallas_kernels.ragged_paged_attention.heuristics import choose_splits, tiling

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# q_lens, kv_lens, hq, hkv, d, block_size, sliding_window, soft_cap, pad_tokens, pad_seqs, dtype
CASES = [
    # mixed: decode, short and long prefill chunks, context not a multiple of the block size
    ([1, 7, 16, 100], [37, 7, 50, 130], 4, 1, 16, 16, None, None, 3, 1, jnp.float32),
    # decode-only, GQA 8, soft cap, block size 8 (two pages per 16-key tile)
    ([1, 1, 1, 1, 1], [1, 9, 33, 64, 70], 8, 1, 32, 8, None, 20.0, 2, 2, jnp.float32),
    # prefill-only, GQA 4 over 2 kv heads, sliding window
    ([100, 7], [100, 20], 8, 2, 16, 16, 24, None, 0, 0, jnp.float32),
    # mixed in bf16 with window and soft cap together, GQA 1
    ([1, 16, 7], [45, 16, 60], 2, 2, 32, 16, 32, 30.0, 4, 1, jnp.bfloat16),
    # prefill and decode in bf16, GQA 8
    ([100, 1, 1], [120, 1, 80], 8, 1, 16, 32, None, None, 1, 0, jnp.bfloat16),
]


def _jnp(b, dtype):
    out = {k: jnp.asarray(v) for k, v in b.items()}
    for name in ("q", "k_cache", "v_cache"):
        out[name] = out[name].astype(dtype)
    return out


def _run(impl, b, **kw):
    return jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.3, impl=impl, **kw))(b)


def test_kernel_matches_reference():
    rng = np.random.default_rng(0)
    for ql, kl, hq, hkv, d, bs, sw, sc, pt, ps, dtype in CASES:
        b = make_batch(
            rng,
            ql,
            kl,
            hq=hq,
            hkv=hkv,
            d=d,
            block_size=bs,
            max_blocks=-(-max(kl) // bs) + 1,
            pad_tokens=pt,
            pad_seqs=ps,
            unused_entry=-1 if bs == 16 else None,
        )
        bj = _jnp(b, dtype)
        got = np.asarray(_run("pallas", bj, sliding_window=sw, soft_cap=sc), np.float32)
        want = np.asarray(_run("reference", bj, sliding_window=sw, soft_cap=sc), np.float32)
        assert np.isfinite(got).all(), ql
        n = sum(ql)
        assert (got[n:] == 0).all(), "padding tokens must produce exact zeros"
        np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{ql}")


def test_forced_splits_agree():
    rng = np.random.default_rng(1)
    b = make_batch(
        rng,
        [1, 1, 7, 1],
        [200, 3, 150, 64],
        hq=4,
        hkv=2,
        d=16,
        block_size=16,
        max_blocks=14,
        pad_tokens=2,
    )
    bj = _jnp(b, jnp.float32)
    outs = [np.asarray(_run("pallas", bj, num_kv_splits=s)) for s in (1, 3, 8)]
    want = np.asarray(_run("reference", bj))
    for o in outs:
        np.testing.assert_allclose(o, want, atol=2e-5, rtol=2e-5)
        assert (o[10:] == 0).all()
    np.testing.assert_allclose(outs[0], outs[2], atol=2e-5, rtol=2e-5)


def _abstract(t, hq, hkv, d, bs, nb, s, mb, dtype):
    return (
        jax.ShapeDtypeStruct((t, hq, d), dtype),
        jax.ShapeDtypeStruct((nb, bs, hkv, d), dtype),
        jax.ShapeDtypeStruct((nb, bs, hkv, d), dtype),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, mb), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_to_triton(platform):
    shapes = [
        # production decode: 256 sequences, Hq 32 / Hkv 8, D 128, block 16, 2k context
        (_abstract(256, 32, 8, 128, 16, 8192, 256, 128, jnp.bfloat16), {}),
        # production prefill chunk with window and soft cap
        (
            _abstract(2048, 32, 8, 128, 16, 8192, 8, 256, jnp.bfloat16),
            dict(sliding_window=512, soft_cap=30.0),
        ),
        # small decode batch split along KV, f32, GQA 8, D 64, block 32
        (_abstract(4, 8, 1, 64, 32, 512, 4, 64, jnp.float32), dict(num_kv_splits=8)),
    ]
    for args, kw in shapes:
        fn = lambda *a, kw=kw: ragged_paged_attention(
            *a, sm_scale=0.1, impl="pallas", interpret=False, **kw
        )
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def test_selection():
    q = jnp.zeros((8, 8, 256), jnp.bfloat16)
    kc = jnp.zeros((4, 16, 2, 256), jnp.bfloat16)
    c = select(q, kc, platform="cuda")
    assert c.impl == "reference" and "head_dim 256" in dict(c.rejected)["pallas"]
    with pytest.raises(BackendError, match="head_dim 256"):
        select(q, kc, platform="rocm", impl="pallas")
    q, kc = q[..., :128], kc[..., :128]
    assert select(q, kc, platform="cuda").impl == "pallas"
    assert select(q, kc, platform="rocm", sliding_window=64, soft_cap=5.0).impl == "pallas"
    c = select(q, kc, platform="cpu")
    assert c.impl == "reference" and not c.interpret
    c = select(q, kc, platform="cpu", impl="pallas")
    assert c.impl == "pallas" and c.interpret
    c = select(q, kc.astype(jnp.float8_e4m3fn), platform="cuda")
    assert c.impl == "reference" and "float8_e4m3fn" in dict(c.rejected)["pallas"]
    c = select(q[..., :96], kc[..., :96], platform="cuda")
    assert c.impl == "reference" and "head_dim 96" in dict(c.rejected)["pallas"]
    c = select(q, jnp.zeros((4, 24, 2, 128), jnp.bfloat16), platform="cuda")
    assert c.impl == "reference" and "block_size 24" in dict(c.rejected)["pallas"]
    assert backends.select("ragged_paged_attention", platform="cpu").impl == "reference"


def test_split_heuristic():
    kw = dict(max_blocks=128, block_size=16, hq=32, hkv=8, cores=132)
    assert tiling(num_tokens=256, max_seqs=256, **kw).num_splits == 1
    small = tiling(num_tokens=4, max_seqs=4, **kw)
    assert small.num_splits > 1 and small.num_splits & (small.num_splits - 1) == 0
    assert small.block_q * small.group >= 16
    assert tiling(num_tokens=4, max_seqs=4, num_kv_splits=3, **kw).num_splits == 3
    prefill = tiling(num_tokens=2048, max_seqs=2, **kw)
    assert prefill.rows == 64 and prefill.num_splits == 1
    assert choose_splits(programs=8, tiles_per_seq=2, cores=132) == 1
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1"):
        tiling(num_tokens=4, max_seqs=4, num_kv_splits=0, **kw)
    with pytest.raises(ValueError, match="'many'"):
        tiling(num_tokens=4, max_seqs=4, num_kv_splits="many", **kw)


def test_reference_chunking_is_shape_driven():
    assert ref.choose_chunk(256, 256, 2048, 32, 8, 128) <= 8
    assert ref.choose_chunk(2048, 1, 2048, 32, 8, 128) >= 64


def _poison_unattended(b, *, sliding_window):
    """NaN K and +-inf V at every context position of every sequence that none of its query
    tokens attends (before the window), and at the last position of every prefill of 2+ tokens
    (past the causal diagonal of all its other tokens). Returns the poisoned batch and bool[T]:
    the tokens whose attended keys are all clean."""
    kc, vc = b["k_cache"].copy(), b["v_cache"].copy()
    bs = kc.shape[1]
    clean = np.zeros(b["q"].shape[0], bool)
    cu, tables = b["cu_q_lens"], b["block_tables"]
    for s in range(int(b["num_seqs"])):
        kl, ql = int(b["kv_lens"][s]), int(cu[s + 1] - cu[s])
        clean[cu[s] : cu[s + 1]] = True
        poisoned = list(range(max(kl - ql - sliding_window + 1, 0))) if sliding_window else []
        if ql > 1:
            poisoned.append(kl - 1)
            clean[cu[s + 1] - 1] = False
        for p in poisoned:
            page, slot = tables[s, p // bs], p % bs
            kc[page, slot] = np.nan
            vc[page, slot] = np.where(np.arange(vc.shape[-1]) % 2, np.inf, -np.inf)
    return dict(b, k_cache=kc, v_cache=vc), clean


def test_nan_and_inf_in_unattended_keys_never_reach_a_token():
    """The scenario that used to break: keys inside a sequence's context that a token does not
    attend (before its sliding window: pages a window lets go stale; after its causal diagonal:
    later tokens of the same chunk) still went into the value dot with probability 0, and
    0 * NaN = NaN. Now every clean token equals the clean run exactly, and a token that attends a
    non-finite value is NaN in both implementations alike."""
    rng = np.random.default_rng(5)
    # q_lens, kv_lens, hq, hkv, d, block_size, sliding_window, dtype
    for ql, kl, hq, hkv, d, bs, sw, dtype in [
        ([1, 7, 16, 100], [70, 40, 50, 130], 4, 1, 16, 16, 24, jnp.float32),
        ([1, 30, 1], [45, 30, 60], 8, 2, 32, 8, None, jnp.float32),
        ([1, 16, 7], [45, 16, 60], 2, 2, 32, 16, 32, jnp.bfloat16),
    ]:
        b = make_batch(
            rng, ql, kl, hq=hq, hkv=hkv, d=d, block_size=bs, max_blocks=-(-max(kl) // bs) + 1
        )
        poisoned, clean = _poison_unattended(b, sliding_window=sw)
        got = {}
        for impl in ("pallas", "reference"):
            want = np.asarray(_run(impl, _jnp(b, dtype), sliding_window=sw), np.float32)
            got[impl] = np.asarray(_run(impl, _jnp(poisoned, dtype), sliding_window=sw), np.float32)
            assert np.isfinite(got[impl][clean]).all(), (impl, ql)
            np.testing.assert_array_equal(got[impl][clean], want[clean], err_msg=f"{impl} {ql}")
            n = sum(ql)
            assert np.isnan(got[impl][:n][~clean[:n]]).all(), (impl, ql)
        np.testing.assert_allclose(
            got["pallas"], got["reference"], atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{ql}"
        )
