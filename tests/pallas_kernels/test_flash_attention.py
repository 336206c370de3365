"""Flash attention: the kernel against the reference (interpret mode), the reference against a
per-query numpy loop, lowering for CUDA and ROCm, and backend selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backends import BackendError
from pallas_kernels.flash_attention import flash_attention, select

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _inputs(rng, b, s, h, hkv, d, *, pad=0, segments=True):
    """Random q/k/v; segment ids pack 1-3 sequences per row, the last `pad` tokens a padding
    segment (id 0)."""
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    if not segments:
        return q, k, v, None
    seg = np.sort(rng.integers(1, 4, (b, s)), axis=1).astype(np.int32)
    if pad:
        seg[:, s - pad :] = 0
    return q, k, v, seg


def _numpy(q, k, v, seg, *, causal, sm_scale):
    b, s, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, s, h, d))
    for bi in range(b):
        for i in range(s):
            keys = [j for j in range(s) if (not causal or j <= i)]
            if seg is not None:
                keys = [j for j in keys if seg[bi, j] == seg[bi, i]]
            for hi in range(h):
                sc = k[bi, keys, hi // g].astype(np.float64) @ q[bi, i, hi] * sm_scale
                w = np.exp(sc - sc.max())
                out[bi, i, hi] = (w / w.sum()) @ v[bi, keys, hi // g]
    return out


def _run(impl, q, k, v, seg, *, causal, dtype):
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    segj = None if seg is None else jnp.asarray(seg)
    fn = jax.jit(
        lambda q, k, v, s: flash_attention(
            q, k, v, causal=causal, sm_scale=0.3, segment_ids=s, impl=impl
        )
    )
    return np.asarray(fn(*args, segj), np.float32)


def test_reference_matches_numpy_loop():
    rng = np.random.default_rng(0)
    for b, s, h, hkv, causal, segments in [
        (2, 13, 4, 1, True, True),
        (1, 9, 2, 2, False, True),
        (1, 11, 4, 2, True, False),
    ]:
        q, k, v, seg = _inputs(rng, b, s, h, hkv, 8, pad=3, segments=segments)
        got = _run("reference", q, k, v, seg, causal=causal, dtype=jnp.float32)
        want = _numpy(q, k, v, seg, causal=causal, sm_scale=0.3)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


# b, s, h, hkv, d, causal, segments, pad, dtype
CASES = [
    (2, 37, 4, 1, 16, True, True, 5, jnp.float32),  # GQA 4, S under one block
    (1, 100, 2, 2, 32, False, True, 20, jnp.float32),  # two key tiles with a ragged tail
    (1, 130, 8, 2, 16, True, False, 0, jnp.float32),  # three tiles, causal early stop
    (2, 16, 4, 4, 32, False, False, 0, jnp.bfloat16),  # exactly one block
    (1, 70, 8, 1, 16, True, True, 7, jnp.bfloat16),  # GQA 8
]


def test_kernel_matches_reference():
    rng = np.random.default_rng(1)
    for b, s, h, hkv, d, causal, segments, pad, dtype in CASES:
        q, k, v, seg = _inputs(rng, b, s, h, hkv, d, pad=pad, segments=segments)
        got = _run("pallas", q, k, v, seg, causal=causal, dtype=dtype)
        want = _run("reference", q, k, v, seg, causal=causal, dtype=dtype)
        # Padding tokens attend among themselves: finite, and checked like every other row.
        assert np.isfinite(got).all(), (b, s, h)
        np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{s}")


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_to_triton(platform):
    shapes = [
        (8, 512, 12, 12, 64, False, True, jnp.bfloat16),  # BERT-base encoder batch
        (4, 1000, 32, 8, 128, True, True, jnp.bfloat16),  # causal GQA pooling model, odd S
        (2, 77, 12, 12, 32, False, False, jnp.float32),  # MiniLM-like, f32
    ]
    for b, s, h, hkv, d, causal, segments, dtype in shapes:
        args = [jax.ShapeDtypeStruct((b, s, n, d), dtype) for n in (h, hkv, hkv)]
        seg = jax.ShapeDtypeStruct((b, s), jnp.int32) if segments else None
        fn = lambda q, k, v, sid, c=causal: flash_attention(
            q, k, v, causal=c, sm_scale=0.1, segment_ids=sid, impl="pallas", interpret=False
        )
        text = jax.jit(fn).trace(*args, seg).lower(lowering_platforms=(platform,)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def test_selection():
    q = jnp.zeros((1, 8, 4, 256), jnp.bfloat16)
    c = select(q, q, platform="cuda", segment_ids=jnp.zeros((1, 8), jnp.int32))
    assert c.impl == "reference" and "head_dim 256" in dict(c.rejected)["pallas"]
    with pytest.raises(BackendError, match="head_dim 256"):
        select(q, q, platform="rocm", impl="pallas")
    q = q[..., :64]
    assert select(q, q, platform="rocm", causal=True).impl == "pallas"
    c = select(q, q, platform="cpu")
    assert c.impl == "reference" and not c.interpret
    assert select(q, q, platform="cpu", impl="pallas").interpret
    c = select(q, q.astype(jnp.float32), platform="cuda")
    assert c.impl == "reference" and "differs" in dict(c.rejected)["pallas"]


def test_bad_shapes_raise_clear_errors():
    q = jnp.ones((1, 8, 6, 16))
    with pytest.raises(ValueError, match="q heads 6 not a multiple of kv heads 4"):
        flash_attention(
            q, jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 4, 16)), causal=False, sm_scale=1.0
        )
    with pytest.raises(ValueError, match=r"segment_ids \(1, 7\)"):
        flash_attention(q, q, q, causal=False, sm_scale=1.0, segment_ids=jnp.zeros((1, 7)))


def _segment_layout(b, s, pad):
    """Three segments of roughly equal length per row, then `pad` padding tokens (id 0)."""
    seg = np.zeros((b, s), np.int32)
    n = s - pad
    for i in range(3):
        seg[:, i * n // 3 : (i + 1) * n // 3] = i + 1
    return seg


def _poison(q, k, v, seg, *, causal):
    """NaN and inf in the K/V of segment 2 and in every padding token's q/k/v; with `causal`, also
    in the last token of segment 3. Returns the poisoned copies and bool[B, S]: the rows whose
    attended keys are all clean, which must come out exactly as in the clean run."""
    q, k, v = q.copy(), k.copy(), v.copy()
    in_two = seg == 2
    k[in_two] = np.nan
    v[in_two] = np.where(np.arange(v.shape[-1]) % 2, np.inf, -np.inf)
    k[seg == 0], v[seg == 0], q[seg == 0] = np.nan, np.inf, np.nan
    clean = (seg != 2) & (seg != 0)
    if causal:
        for bi in range(seg.shape[0]):
            last = np.flatnonzero(seg[bi] == 3)[-1]
            k[bi, last, 0, 0], v[bi, last, 0, 1] = np.inf, np.nan
            clean[bi, last] = False
    return q, k, v, clean


# b, s, h, hkv, d, causal, pad, dtype
POISON_CASES = [
    (2, 37, 4, 1, 16, True, 5, jnp.float32),  # all segments and padding in one key tile
    (1, 100, 2, 2, 32, False, 20, jnp.float32),  # two key tiles, a segment across their border
    (1, 70, 8, 1, 16, True, 7, jnp.bfloat16),
]


def test_nan_and_inf_in_masked_keys_never_reach_a_row():
    """The scenario that used to break: a masked key's probability is 0, but 0 * NaN in the value
    dot is NaN, so a NaN in another segment's V (or padding's, or a later token's under the causal
    mask) reached every row of the tile. Now each clean row equals the clean run exactly, and a
    row that attends a non-finite key is NaN in both implementations alike."""
    rng = np.random.default_rng(4)
    for b, s, h, hkv, d, causal, pad, dtype in POISON_CASES:
        q, k, v, _ = _inputs(rng, b, s, h, hkv, d, segments=False)
        seg = _segment_layout(b, s, pad)
        pq, pk, pv, clean = _poison(q, k, v, seg, causal=causal)
        got = {}
        for impl in ("pallas", "reference"):
            want = _run(impl, q, k, v, seg, causal=causal, dtype=dtype)
            got[impl] = _run(impl, pq, pk, pv, seg, causal=causal, dtype=dtype)
            assert np.isfinite(got[impl][clean]).all(), (impl, s)
            np.testing.assert_array_equal(got[impl][clean], want[clean], err_msg=f"{impl} {s}")
            assert np.isnan(got[impl][seg == 2]).all(), (impl, s)
        np.testing.assert_allclose(
            got["pallas"], got["reference"], atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"{s}"
        )


def test_a_later_nan_under_the_causal_mask_stays_out_of_earlier_rows():
    rng = np.random.default_rng(5)
    q, k, v, _ = _inputs(rng, 1, 50, 4, 2, 16, segments=False)
    pk, pv = k.copy(), v.copy()
    pk[0, 30:], pv[0, 40:] = np.nan, np.inf
    for impl in ("pallas", "reference"):
        want = _run(impl, q, k, v, None, causal=True, dtype=jnp.float32)
        got = _run(impl, q, pk, pv, None, causal=True, dtype=jnp.float32)
        np.testing.assert_array_equal(got[0, :30], want[0, :30], err_msg=impl)
        assert np.isnan(got[0, 30:]).all(), impl
