"""The C++ attention kernels (pallas_kernels/ragged_paged_attention/native.py) against the jnp
reference, the jnp fast paths and the per-token numpy loop: decode steps and causal steps mixing
whole prompts, continued chunks and single tokens; ragged contexts with padding rows and sequences,
GQA groups, head dims, block sizes, sliding windows, soft caps, NaN in keys and values no token
attends and in a value one does, steps a kernel does not serve; their build (cached per host, a
clear error without a compiler) and the dispatcher's routing to them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import as_jnp, case_batch, make_batch, numpy_attention

from pallas_kernels import native_build
from pallas_kernels.ragged_paged_attention import (
    decode,
    native,
    ragged_paged_attention,
    reference,
)

# kv_lens, hq, hkv, d, block_size, sliding_window, soft_cap, pad_seqs, pad_tokens
CASES = [
    ([5, 130, 1, 257, 128, 64], 4, 2, 16, 16, None, None, 2, 3),
    ([33, 17, 2, 1, 300], 6, 3, 32, 8, 20, 30.0, 1, 0),
    ([129, 255, 256], 8, 8, 64, 32, None, 5.0, 0, 5),
    ([7, 61, 300], 8, 1, 128, 256, 100, None, 3, 1),
    ([3, 1000], 2, 1, 256, 4, None, None, 0, 0),
    ([77, 500, 12], 16, 2, 80, 16, 64, 50.0, 1, 2),
    # groups that value tiles of 4 or 2 heads do not divide (the last tile overlaps)
    ([45, 16, 290], 6, 2, 64, 16, None, None, 1, 1),
    ([31, 600], 7, 1, 64, 8, None, None, 0, 2),
    ([200, 9], 10, 2, 128, 16, 50, None, 2, 0),
]


def _batch(rng, kv_lens, hq, hkv, d, bs, pad_seqs, pad_tokens, poison=True):
    q_lens = [1] * len(kv_lens)  # decode steps
    return case_batch(rng, q_lens, kv_lens, hq, hkv, d, bs, pad_seqs, pad_tokens, poison)


def _native(options, kind="decode"):
    return jax.jit(lambda b: getattr(native, kind)(**b, **options))


def test_builds_here_per_head_dim():
    # CI installs a compiler (.ci/run): the kernels are never silently absent there.
    assert native.available(64) and native.library("write") is not None
    for kind in native.ATTENTION:
        path = native.library(kind, 64)
        assert path is not None and "-vlax_head_dim64-" in path.name, path
        assert native.library(kind, 32) != path  # another head dim: another library
    # A head dim no kernel serves builds nothing but the write kernel: a bf16 model of it keeps
    # f32 caches (cpu_bf16.py).
    assert not native.available(72) and set(native.prepare(72)) == {"write"}


def test_matches_reference_live_chunks_and_per_token_loop():
    """Fresh random inputs with NaN in every page, page tail and query row no token reads."""
    rng = np.random.default_rng(0)
    for kl, hq, hkv, d, bs, sw, sc, ps, pt in CASES:
        b = _batch(rng, kl, hq, hkv, d, bs, ps, pt)
        options = dict(sm_scale=d**-0.5, sliding_window=sw, soft_cap=sc)
        out = np.asarray(_native(options)(as_jnp(b)))
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))(as_jnp(b))
        chunks = decode.live_chunks(kl, bs)
        live = jax.jit(
            lambda b, o=options, n=chunks: decode.ragged_paged_decode(**b, num_chunks=n, **o)
        )(as_jnp(b))
        where = f"{kl} hq={hq} hkv={hkv} d={d} bs={bs} window={sw} cap={sc}"
        assert out.dtype == np.float32 and np.isfinite(out).all(), where
        np.testing.assert_allclose(out, numpy_attention(b, **options), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5, err_msg=where)
        np.testing.assert_allclose(out, live, atol=2e-6, rtol=2e-5, err_msg=where)
        assert (out[len(kl) :] == 0).all(), where  # padding query rows


def test_a_value_a_token_attends_that_is_not_finite_makes_it_nan():
    """Only the heads of the sequence that attends it, as the reference (masked_values.py);
    a NaN in a key it attends gives the reference's NaN too."""
    rng = np.random.default_rng(1)
    kl, hq, hkv, d, bs = [40, 70, 9], 4, 2, 32, 16
    b = _batch(rng, kl, hq, hkv, d, bs, 1, 1)
    options = dict(sm_scale=d**-0.5)
    ref = jax.jit(lambda b: reference.ragged_paged_attention(**b, **options))
    for cache, value in (("v_cache", np.nan), ("v_cache", np.inf), ("k_cache", np.nan)):
        bad = dict(b)
        x = b[cache].copy()
        x[b["block_tables"][1, 33 // bs], 33 % bs, 1, 5] = value  # sequence 1, kv head 1
        bad[cache] = x
        out = np.asarray(_native(options)(as_jnp(bad)))
        want = np.asarray(ref(as_jnp(bad)))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want), err_msg=f"{cache} {value}")
        assert np.isnan(out[1, 2:]).all() and np.isfinite(out[1, :2]).all(), (cache, value)
        assert np.isfinite(np.delete(out, 1, axis=0)).all(), (cache, value)


def test_a_step_that_is_not_a_decode_is_all_nan():
    rng = np.random.default_rng(2)
    two = make_batch(rng, [2, 1], [30, 20], hq=4, hkv=2, d=16, block_size=16, max_blocks=4)
    assert np.isnan(np.asarray(_native(dict(sm_scale=0.25))(as_jnp(two)))).all()


TARGET = native.KERNELS["decode"][2]


def test_dispatcher_sends_f32_and_bf16_decode_steps_here_and_the_rest_toas_jnp():
    rng = np.random.default_rng(3)
    kl = [40, 3, 17, 90]
    b = as_jnp(_batch(rng, kl, 8, 2, 16, 8, 2, 2))
    chunks = decode.live_chunks(kl, 8)

    def hlo(b, **kw):
        f = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.25, **kw))
        return f.lower(b).as_text()

    assert TARGET in hlo(b, decode_chunks=chunks)
    # not a counted decode step: the prefill kernel, which serves any step
    assert TARGET not in hlo(b) and native.KERNELS["prefill"][2] in hlo(b)
    for dtype, served in ((jnp.bfloat16, True), (jnp.float16, False)):  # f16: decode.py
        narrow = {
            k: x.astype(dtype) if k in ("q", "k_cache", "v_cache") else x for k, x in b.items()
        }
        assert (TARGET in hlo(narrow, decode_chunks=chunks)) is served, dtype
    odd = dict(b, q=b["q"][..., :8], k_cache=b["k_cache"][..., :8], v_cache=b["v_cache"][..., :8])
    assert TARGET not in hlo(odd, decode_chunks=chunks)  # head dim 8
    plain = jax.jit(lambda b: reference.ragged_paged_attention(**b, sm_scale=0.25))(b)
    fast = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.25, decode_chunks=chunks))(b)
    np.testing.assert_allclose(fast, plain, atol=2e-6, rtol=2e-5)


def test_without_a_library_the_dispatcher_keeps_the_jnp_path(monkeypatch):
    monkeypatch.setattr(native, "library", lambda kind, head_dim=None: None)
    q = jax.ShapeDtypeStruct((4, 8, 64), jnp.float32)
    assert not native.serves("decode", q, jax.ShapeDtypeStruct((9, 16, 2, 64), jnp.float32))
    b = as_jnp(_batch(np.random.default_rng(4), [5, 9], 4, 2, 16, 8, 0, 0))
    f = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.25, decode_chunks=2))
    assert TARGET not in f.lower(b).as_text()
    with pytest.raises(native_build.BuildError, match="did not build"):
        native.decode(**b, sm_scale=0.25)


def test_build_is_cached_per_host_and_says_why_it_cannot_build(monkeypatch, tmp_path):
    monkeypatch.setenv("VLAX_CACHE_DIR", str(tmp_path))
    source, d16 = native.KERNELS["decode"][0], (("VLAX_HEAD_DIM", 16),)
    first = native_build.build(source, d16)
    assert first.parent == tmp_path / "native" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native_build.build(source, d16) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    with pytest.raises(native_build.BuildError, match="VLAX_HEAD_DIM"):  # the head dim it needs
        native_build.build(source)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(native_build.BuildError, match="no-such-compiler"):
        native_build.build(source, d16)
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.delenv("CXX")
    with pytest.raises(native_build.BuildError, match="failed"):
        native_build.build(broken)


# q_lens, kv_lens, hq, hkv, d, block_size, sliding_window, soft_cap, pad_seqs, pad_tokens
PREFILL_CASES = [
    ([300, 1, 57, 128], [300, 40, 200, 128], 8, 2, 64, 16, None, None, 2, 3),
    ([5, 70, 1, 33], [5, 100, 9, 33], 6, 3, 32, 8, 20, 30.0, 1, 0),
    ([129, 3], [260, 3], 4, 4, 16, 32, None, 5.0, 0, 5),
    ([64, 17], [64, 500], 16, 1, 128, 256, 100, None, 3, 1),
    ([7], [7], 2, 1, 80, 4, None, None, 0, 0),
]


def test_prefill_matches_reference_tiles_and_per_token_loop():
    """Whole prompts, chunks continuing a context and single tokens in one step; NaN in every
    page, page tail and query row no token reads."""
    rng = np.random.default_rng(5)
    for ql, kl, hq, hkv, d, bs, sw, sc, ps, pt in PREFILL_CASES:
        b = make_batch(
            rng, ql, kl, hq=hq, hkv=hkv, d=d, block_size=bs,
            max_blocks=-(-max(kl) // bs) + 2, pad_seqs=ps, pad_tokens=pt,
        )  # fmt: skip
        options = dict(sm_scale=d**-0.5, sliding_window=sw, soft_cap=sc)
        out = np.asarray(_native(options, "prefill")(as_jnp(b)))
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))(as_jnp(b))
        where = f"{ql} {kl} hq={hq} hkv={hkv} d={d} bs={bs} window={sw} cap={sc}"
        assert out.dtype == np.float32 and np.isfinite(out).all(), where
        np.testing.assert_allclose(out, numpy_attention(b, **options), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5, err_msg=where)
        assert (out[sum(ql) :] == 0).all(), where  # padding query rows


# (query tokens, context, prefix length): a prefix LM's step (PaliGemma), each a named scenario
PREFIX_CASES = {
    "whole prompt is the prefix": (70, 70, 70),
    "prefix then a causal suffix in one step": (90, 90, 40),
    "one token after the prefix": (1, 30, 16),
    "last tokens of a prefix whose first blocks are cached": (5, 44, 44),
    "suffix tokens after a cached prefix": (6, 26, 20),
    "no prefix (causal)": (37, 37, 0),
    "prefix longer than the context so far": (20, 20, 300),
}


def test_prefill_serves_a_prefix_lm_as_the_reference():
    """prefix_lens: a token sees every key up to max(its position, prefix - 1) (reference.py);
    f32 and bf16 (rounded probabilities across 512-key blocks), with and without a window, and
    the dispatcher sends such a step here."""
    rng = np.random.default_rng(8)
    names = list(PREFIX_CASES)
    q_lens, kv_lens, prefix = zip(*PREFIX_CASES.values(), strict=True)
    b = as_jnp(
        make_batch(
            rng, q_lens, kv_lens, hq=8, hkv=2, d=64, block_size=16, max_blocks=8, pad_tokens=3,
            pad_seqs=1,
        )
    )  # fmt: skip
    lens = jnp.asarray([*prefix, 0], jnp.int32)
    rows = np.cumsum([0, *q_lens])
    for window, dtype in ((None, jnp.float32), (24, jnp.float32), (None, jnp.bfloat16)):
        options = dict(sm_scale=0.125, sliding_window=window)
        q = dict(b, q=b["q"].astype(dtype))
        out = jax.jit(lambda b, p, o=options: native.prefill(**b, prefix_lens=p, **o))(q, lens)
        ref = jax.jit(
            lambda b, p, o=options: reference.ragged_paged_attention(**b, prefix_lens=p, **o)
        )(q, lens)
        out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        for i, name in enumerate(names):
            got, want = out[rows[i] : rows[i + 1]], ref[rows[i] : rows[i + 1]]
            where = f"{name}, window {window}, {jnp.dtype(dtype).name}"
            assert np.isfinite(got).all(), where
            tol = (
                dict(atol=2e-6, rtol=2e-5) if dtype == jnp.float32 else dict(rtol=2**-7, atol=2**-9)
            )
            np.testing.assert_allclose(got, want, err_msg=where, **tol)
    # The dispatcher sends such a step here with or without a pair count: an image model's steps
    # (PaliGemma, ColPali) carry none. Used to break: without one they took the reference.
    for count in (8, 0):
        step = jax.jit(
            lambda b, p, c=count: ragged_paged_attention(
                **b, prefix_lens=p, sm_scale=0.125, tile_chunks=c
            )
        )
        assert native.KERNELS["prefill"][2] in step.lower(b, lens).as_text(), count
        want = jax.jit(
            lambda b, p: reference.ragged_paged_attention(**b, prefix_lens=p, sm_scale=0.125)
        )(b, lens)
        np.testing.assert_allclose(step(b, lens), want, atol=2e-6, rtol=2e-5, err_msg=str(count))


def test_prefill_nan_in_an_attended_value_reaches_only_the_rows_that_attend_it():
    rng = np.random.default_rng(6)
    ql, kl, hq, hkv, d, bs = [50, 20], [50, 60], 4, 2, 32, 16
    b = make_batch(rng, ql, kl, hq=hq, hkv=hkv, d=d, block_size=bs, max_blocks=6)
    v = b["v_cache"].copy()
    v[b["block_tables"][0, 30 // bs], 30 % bs, 0, 3] = np.nan  # sequence 0, position 30, kv head 0
    bad = dict(b, v_cache=v)
    options = dict(sm_scale=d**-0.5)
    out = np.asarray(_native(options, "prefill")(as_jnp(bad)))
    ref = np.asarray(
        jax.jit(lambda b: reference.ragged_paged_attention(**b, **options))(as_jnp(bad))
    )
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    # Tokens at positions 30.. of sequence 0 (rows 30..49), heads 0-1 of kv head 0: NaN.
    assert np.isnan(out[30:50, :2]).all() and np.isfinite(out[:30]).all()
    assert np.isfinite(out[30:50, 2:]).all() and np.isfinite(out[50:]).all()
    # Windowed: a row whose window starts past position 30 no longer sees it.
    windowed = dict(options, sliding_window=8)
    out = np.asarray(_native(windowed, "prefill")(as_jnp(bad)))
    assert np.isnan(out[30:38, :2]).all() and np.isfinite(out[38:50]).all()


def test_prefill_of_more_tokens_than_context_is_all_nan():
    rng = np.random.default_rng(7)
    b = make_batch(rng, [9, 3], [9, 20], hq=4, hkv=2, d=16, block_size=8, max_blocks=4)
    b["kv_lens"] = b["kv_lens"].copy()
    b["kv_lens"][0] = 5  # 9 query tokens in a context of 5
    assert np.isnan(np.asarray(_native(dict(sm_scale=0.25), "prefill")(as_jnp(b)))).all()


def test_dispatcher_sends_f32_tiled_steps_to_the_prefill_kernel():
    rng = np.random.default_rng(8)
    ql, kl = [40, 1, 17], [90, 3, 17]
    b = as_jnp(make_batch(rng, ql, kl, hq=8, hkv=2, d=16, block_size=8, max_blocks=14))
    pairs = 2 * tiles_count(ql, kl)
    f = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.25, tile_chunks=pairs))
    assert native.KERNELS["prefill"][2] in f.lower(b).as_text()
    plain = jax.jit(lambda b: reference.ragged_paged_attention(**b, sm_scale=0.25))(b)
    np.testing.assert_allclose(f(b), plain, atol=2e-6, rtol=2e-5)


def tiles_count(q_lens, kv_lens):
    from pallas_kernels.ragged_paged_attention import tiles

    return tiles.tile_chunks(zip(q_lens, kv_lens, strict=True), 8)


def test_bf16_queries_round_their_probabilities_as_the_reference():
    """A bf16 model's step (bf16 queries, f32 caches holding bf16 values): the probabilities
    round to bf16 against the running maximum over 512-key blocks (rounding.py), decode and
    prefill alike, across block boundaries; outputs agree with the reference's rounding to within
    one bf16 ulp on a few percent of elements, and are far from the unrounded f32 result there."""
    rng = np.random.default_rng(9)
    cases = [
        ("decode", [1, 1, 1, 1], [700, 30, 1100, 513]),
        ("prefill", [600, 1, 40], [600, 900, 1040]),
    ]
    for kind, ql, kl in cases:
        b = make_batch(rng, ql, kl, hq=8, hkv=2, d=64, block_size=16, max_blocks=72)
        b = as_jnp(b)
        for name in ("q", "k_cache", "v_cache"):  # bf16 values; the caches stay f32
            b[name] = b[name].astype(jnp.bfloat16).astype(jnp.float32)
        bf = dict(b, q=b["q"].astype(jnp.bfloat16))
        options = dict(sm_scale=0.125)
        out = np.asarray(_native(options, kind)(bf).astype(jnp.float32))
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))(bf)
        ref = np.asarray(ref.astype(jnp.float32))
        rows = sum(ql)
        assert np.isfinite(out[:rows]).all(), kind
        differ = out[:rows] != ref[:rows]
        assert differ.mean() < 0.05, (kind, differ.mean())
        np.testing.assert_allclose(out[:rows], ref[:rows], rtol=2**-7, atol=2**-9, err_msg=kind)
        # Unrounded probabilities, the output then rounded: many more elements differ.
        plain = np.asarray(_native(options, kind)(b).astype(jnp.bfloat16).astype(jnp.float32))
        assert (plain[:rows] != ref[:rows]).mean() > 3 * differ.mean() + 0.02, kind


def test_bf16_caches_give_what_f32_caches_of_the_same_values_give():
    """The kernels widen bf16 pages as they read them: the same bf16 values held in a bf16 or an
    f32 cache attend alike, bit for bit, for f32 and bf16 queries, decode and prefill."""
    rng = np.random.default_rng(10)
    cases = [("decode", [1, 1, 1], [700, 30, 64]), ("prefill", [300, 1, 40], [300, 90, 600])]
    for kind, ql, kl in cases:
        b = as_jnp(make_batch(rng, ql, kl, hq=8, hkv=2, d=64, block_size=16, max_blocks=46))
        for name in ("k_cache", "v_cache"):
            b[name] = b[name].astype(jnp.bfloat16).astype(jnp.float32)
        narrow = dict(b, k_cache=b["k_cache"].astype(jnp.bfloat16))
        narrow["v_cache"] = b["v_cache"].astype(jnp.bfloat16)
        for q_dtype in (jnp.float32, jnp.bfloat16):
            q = b["q"].astype(q_dtype)
            wide = np.asarray(_native(dict(sm_scale=0.125), kind)(dict(b, q=q)).astype(jnp.float32))
            got = _native(dict(sm_scale=0.125), kind)(dict(narrow, q=q))
            assert got.dtype == q_dtype, (kind, q_dtype)
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), wide)


def test_write_puts_each_row_at_its_slot_in_place_and_drops_padding():
    from pallas_kernels.paged_write import write_rows
    from pallas_kernels.ragged_paged_attention.cache_write import write_kv

    rng = np.random.default_rng(11)
    nb, bs, h, d = 9, 4, 2, 16
    slots = jnp.asarray([5, -1, 0, 35, 36, 99, 17], jnp.int32)  # -1 and past the cache: dropped
    for dtype in (jnp.float32, jnp.bfloat16):
        cache = jnp.asarray(rng.standard_normal((nb, bs, h, d)), dtype)
        rows = jnp.asarray(rng.standard_normal((7, h, d)), jnp.float32)
        want = jax.jit(write_rows)(cache, rows, slots)
        got = jax.jit(native.write)(cache, rows, slots)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(dtype))
        # Donated, the caches are written where they lie: no copy of a cache in the program.
        args = (cache, cache, rows.astype(dtype), rows.astype(dtype), slots)
        hlo = write_kv.lower(*args).compile().as_text()
        assert native.KERNELS["write"][2] in hlo
        copies = [ln for ln in hlo.splitlines() if " copy(" in ln and f"[{nb},{bs},{h},{d}]" in ln]
        assert not copies, (dtype, copies)
