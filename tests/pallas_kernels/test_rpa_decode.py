"""The live-chunk decode path (pallas_kernels/ragged_paged_attention/decode.py) against the jnp
reference and the per-token numpy loop: ragged contexts, padding rows, GQA groups, block sizes
below, at and above a chunk, sliding windows, soft caps, prefix_lens, NaN in keys no token
attends, bf16, and the promises it checks (one query per sequence, enough chunks)."""

import jax
import jax.numpy as jnp
import numpy as np
from rpa_cases import as_jnp, case_batch, make_batch, numpy_attention

from pallas_kernels.ragged_paged_attention import (
    decode,
    ragged_paged_attention,
    reference,
    rounding,
)

# kv_lens, hq, hkv, d, block_size, sliding_window, soft_cap, pad_seqs, pad_tokens
CASES = [
    ([5, 130, 1, 257, 128, 64], 4, 2, 16, 16, None, None, 2, 3),
    ([33, 17, 2, 1, 300], 6, 3, 32, 8, 20, 30.0, 1, 0),
    ([129, 255, 256], 4, 4, 8, 32, None, 5.0, 0, 5),
    ([7, 61, 300], 8, 1, 16, 256, 100, None, 3, 1),
    ([3], 2, 1, 16, 4, None, None, 0, 0),
]


def _batch(rng, kv_lens, hq, hkv, d, bs, pad_seqs, pad_tokens, poison=False):
    q_lens = [1] * len(kv_lens)  # decode steps
    return case_batch(rng, q_lens, kv_lens, hq, hkv, d, bs, pad_seqs, pad_tokens, poison)


def test_live_chunks_match_reference_and_per_token_loop():
    """The fast product alone (no fallback), with the exact chunk count and a larger bucket."""
    rng = np.random.default_rng(0)
    for i, (kl, hq, hkv, d, bs, sw, sc, ps, pt) in enumerate(CASES):
        b = _batch(rng, kl, hq, hkv, d, bs, ps, pt)
        need = decode.live_chunks(kl, bs)
        options = dict(sm_scale=d**-0.5, sliding_window=sw, soft_cap=sc)
        want = numpy_attention(b, **options)
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))(as_jnp(b))
        chunks = need + 5 * (i % 2)  # exact, or with padding chunks
        # One slice holding every chunk, and slices of 2 and 3 (the last one padded or not).
        for most in (None, 16, 2, 3):  # None: this host's choice
            f = jax.jit(
                lambda b, o=options, n=chunks, most=most: decode.ragged_paged_decode(
                    **b, num_chunks=n, slice_chunks=most, exact=False, **o
                )
            )
            out = np.asarray(f(as_jnp(b)))
            where = f"{kl} {bs} chunks={chunks} slice_chunks={most}"
            assert np.isfinite(out).all(), where  # a broken step would be all NaN
            np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=where)
            np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5, err_msg=where)
            assert (out[len(kl) :] == 0).all()


def test_slicing_covers_every_piece_with_the_fewest_slices():
    for n in range(1, 70):
        for most in (1, 2, 3, 16):
            slices, per_slice = decode.slicing(n, most)
            assert per_slice <= most and slices * per_slice >= n, (n, most)
            assert (slices - 1) * per_slice < n and slices == -(-n // most), (n, most)


def test_slice_size_follows_the_host_and_the_chunk_bytes():
    avx512, avx2 = frozenset({"avx2", "avx512f"}), frozenset({"avx2"})
    chunk = 128 * 2 * 64 * 4  # 128 keys of 2 kv heads of 64, f32: the benchmark Llama's
    assert decode.slice_chunks(chunk, avx512) == 2
    assert decode.slice_chunks(chunk // 4, avx512) == 8
    assert decode.slice_chunks(chunk, avx2) == 16
    assert decode.slice_chunks(chunk * 8, avx2) == 2
    assert decode.slice_chunks(chunk * 8, avx512) == decode.MIN_SLICE_CHUNKS  # never one chunk
    assert decode.slice_chunks(chunk, frozenset()) == 16  # flags unreadable: as on AVX2
    cache = jax.ShapeDtypeStruct((9, 16, 2, 64), jnp.bfloat16)  # 32 KiB a chunk
    assert decode.host_slice_chunks(cache) in (4, 32)


def test_dispatcher_serves_decode_steps_with_prefix_lens():
    """Through ragged_paged_attention(decode_chunks=...): the same output as without, and
    prefix_lens (a prefix LM) changes nothing for one query at the end of its context."""
    rng = np.random.default_rng(1)
    kl = [40, 3, 17, 90]
    b = _batch(rng, kl, 8, 2, 16, 8, 2, 2)
    prefix = jnp.asarray([10, 3, 0, 91, 0, 0], jnp.int32)
    chunks = decode.live_chunks(kl, 8)

    @jax.jit
    def both(b):
        plain = ragged_paged_attention(**b, sm_scale=0.25, prefix_lens=prefix)
        fast = ragged_paged_attention(**b, sm_scale=0.25, prefix_lens=prefix, decode_chunks=chunks)
        return plain, fast

    plain, fast = both(as_jnp(b))
    np.testing.assert_allclose(fast, plain, atol=2e-6, rtol=2e-5)


def test_nan_in_keys_no_token_attends_changes_nothing():
    """Unused pages, the tails of last pages and padding query rows hold NaN: the fast product
    turns non-finite and the exact per-head product on the chunks serves; a value a token attends that holds
    NaN makes that token NaN, as in the reference."""
    rng = np.random.default_rng(2)
    for kl, hq, hkv, d, bs, sw, sc, ps, pt in CASES[:2]:
        b = _batch(rng, kl, hq, hkv, d, bs, ps, pt, poison=True)
        options = dict(sm_scale=d**-0.5, sliding_window=sw, soft_cap=sc)
        n = decode.live_chunks(kl, bs)
        # Slices of two chunks: the NaN below sends one slice to the exact product, not the rest.
        f = jax.jit(
            lambda b, o=options, n=n: decode.ragged_paged_decode(
                **b, num_chunks=n, slice_chunks=2, **o
            )
        )
        out = np.asarray(f(as_jnp(b)))
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))
        assert np.isfinite(out).all(), kl
        np.testing.assert_allclose(out, ref(as_jnp(b)), atol=2e-6, rtol=2e-5)
        # A NaN in a value the first sequence attends (its last key) reaches it and no other row.
        bad = dict(b)
        v = b["v_cache"].copy()
        last = kl[0] - 1
        v[b["block_tables"][0, last // bs], last % bs, 0, 0] = np.nan
        bad["v_cache"] = v
        out = np.asarray(f(as_jnp(bad)))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(np.asarray(ref(as_jnp(bad)))))
        assert np.isnan(out[0]).any() and np.isfinite(out[1:]).all()


def test_bf16_close_to_f32():
    rng = np.random.default_rng(3)
    kl = [9, 130, 20]
    b = _batch(rng, kl, 4, 2, 32, 8, 1, 0)
    want = numpy_attention(b, sm_scale=0.2)
    bb = as_jnp(b)
    for name in ("q", "k_cache", "v_cache"):
        bb[name] = bb[name].astype(jnp.bfloat16)
    n = decode.live_chunks(kl, 8)
    out = jax.jit(lambda b: decode.ragged_paged_decode(**b, num_chunks=n, sm_scale=0.2))(bb)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2, rtol=3e-2)
    narrow = jax.jit(
        lambda b: decode.ragged_paged_decode(**b, num_chunks=n, sm_scale=0.2, narrow_dots=True)
    )(bb)
    np.testing.assert_allclose(np.asarray(narrow, np.float32), want, atol=3e-2, rtol=3e-2)
    assert np.mean(np.asarray(narrow != out)) < 0.02


def test_narrow_dots_only_where_the_operands_are_exact():
    """bf16 operands for bf16 queries whose caller vouches for the caches; the value dot only
    where each piece's probabilities round against one maximum (pieces inside a 512-key block)."""

    def rounding_of(keys):
        k_pos = jnp.arange(2 * keys).reshape(2, keys)
        return rounding.for_pieces(jnp.bfloat16, k_pos, jnp.zeros(2, jnp.int32), 1, 4096)

    bf16, f32 = jnp.bfloat16, jnp.float32
    assert decode.dot_dtypes(bf16, rounding_of(128), True) == (bf16, bf16)
    assert decode.dot_dtypes(bf16, rounding_of(1024), True) == (bf16, f32)
    assert decode.dot_dtypes(bf16, rounding_of(128), False) == (f32, f32)
    assert decode.dot_dtypes(f32, None, True) == (f32, f32)


def test_broken_promises_give_nan_not_a_truncated_answer():
    rng = np.random.default_rng(4)
    kl = [300, 20]
    b = _batch(rng, kl, 4, 2, 16, 16, 0, 0)
    f = jax.jit(
        lambda b, n: decode.ragged_paged_decode(**b, num_chunks=n, sm_scale=0.25), static_argnums=1
    )
    assert np.isnan(np.asarray(f(as_jnp(b), decode.live_chunks(kl, 16) - 1))).all()
    two = make_batch(rng, [2, 1], kl, hq=4, hkv=2, d=16, block_size=16, max_blocks=20, poison=False)
    assert np.isnan(np.asarray(f(as_jnp(two), 10))).all()
