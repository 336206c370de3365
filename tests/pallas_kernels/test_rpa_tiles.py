"""The tiled jnp path for steps with multi-token rows (pallas_kernels/ragged_paged_attention/
tiles.py) against the jnp reference and the per-token numpy loop: prefill chunks continuing a
cached context, decode rows in the same step, padding rows and tokens, GQA groups, block sizes
below, at and above a chunk, sliding windows, soft caps, NaN in keys no token attends, bf16, the
host count against the device's, and the dispatcher's routing (prefix_lens goes to the reference)."""

import jax
import jax.numpy as jnp
import numpy as np
from rpa_cases import as_jnp, case_batch, numpy_attention

from pallas_kernels.ragged_paged_attention import native, ragged_paged_attention, reference, tiles

# q_lens, kv_lens, hq, hkv, d, block_size, sliding_window, soft_cap, pad_seqs, pad_tokens
CASES = [
    ([70, 1, 33, 1], [70, 300, 160, 5], 4, 2, 16, 16, None, None, 2, 3),
    ([1, 45, 2], [130, 45, 257], 6, 3, 32, 8, 20, 30.0, 1, 0),
    ([129, 3], [129, 131], 4, 4, 8, 32, None, 5.0, 0, 5),
    ([64, 31, 1], [200, 31, 7], 8, 1, 16, 256, 100, None, 3, 1),
    ([5], [5], 2, 1, 16, 4, None, None, 0, 0),
]


def _tiles(b, n, **options):
    return jax.jit(lambda b: tiles.ragged_paged_tiles(**b, num_pairs=n, **options))(as_jnp(b))


# One slice holding every pair, and slices of 2 and 3 pairs (the last one padded or not).
SLICES = (tiles.SLICE_PAIRS, 2, 3)


def test_tiles_match_reference_and_per_token_loop():
    """Exact pair count and a larger bucket; poisoned pages, page tails and padding rows (NaN)
    change nothing, as no token attends them."""
    rng = np.random.default_rng(0)
    for i, (ql, kl, hq, hkv, d, bs, sw, sc, ps, pt) in enumerate(CASES):
        b = case_batch(rng, ql, kl, hq, hkv, d, bs, ps, pt)
        need = tiles.tile_chunks(zip(ql, kl, strict=True), bs)
        options = dict(sm_scale=d**-0.5, sliding_window=sw, soft_cap=sc)
        want = numpy_attention(b, **options)
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))(as_jnp(b))
        for most in SLICES:
            out = np.asarray(_tiles(b, need + 7 * (i % 2), slice_pairs=most, **options))
            real = sum(ql)
            where = f"case {i} slice_pairs={most}"
            assert np.isfinite(out[:real]).all(), where
            np.testing.assert_allclose(out[:real], want[:real], atol=2e-5, rtol=2e-5, err_msg=where)
            np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5, err_msg=where)
            assert (out[real:] == 0).all()


def test_nan_in_an_attended_value_reaches_that_token_only():
    """A NaN in a value the first sequence's last token attends (its own key) makes that
    token NaN, exactly where the reference does, and no other token."""
    rng = np.random.default_rng(2)
    for ql, kl, hq, hkv, d, bs, sw, sc, ps, pt in CASES[:2]:
        b = case_batch(rng, ql, kl, hq, hkv, d, bs, ps, pt)
        v = b["v_cache"].copy()
        last = kl[0] - 1
        v[b["block_tables"][0, last // bs], last % bs, 0, 0] = np.nan
        b["v_cache"] = v
        options = dict(sm_scale=d**-0.5, sliding_window=sw, soft_cap=sc)
        ref = jax.jit(lambda b, o=options: reference.ragged_paged_attention(**b, **o))(as_jnp(b))
        need = tiles.tile_chunks(zip(ql, kl, strict=True), bs)
        # Slices of 2 pairs: the NaN sends one slice to the exact product, not the others.
        for most in (tiles.SLICE_PAIRS, 2):
            out = np.asarray(_tiles(b, need, slice_pairs=most, **options))
            np.testing.assert_array_equal(np.isnan(out), np.isnan(np.asarray(ref)))
            assert np.isnan(out[ql[0] - 1]).any()
            assert np.isfinite(out[: ql[0] - 1]).all() and np.isfinite(out[ql[0] : sum(ql)]).all()
            finite = np.isfinite(out)
            np.testing.assert_allclose(out[finite], np.asarray(ref)[finite], atol=2e-6, rtol=2e-5)


def test_bf16_close_to_f32():
    """The last sequence's queries see keys in two of torch's 512-key blocks (rounding.py): their
    running maximum spans pairs, so slicing the pairs must not change a bit of the output."""
    rng = np.random.default_rng(3)
    ql, kl = [40, 1, 9, 40], [40, 130, 20, 700]
    b = case_batch(rng, ql, kl, 4, 2, 32, 8, 1, 0, poison=False)
    want = numpy_attention(b, sm_scale=0.2)
    bb = as_jnp(b)
    for name in ("q", "k_cache", "v_cache"):
        bb[name] = bb[name].astype(jnp.bfloat16)
    n = tiles.tile_chunks(zip(ql, kl, strict=True), 8)
    outs = [
        jax.jit(
            lambda b, most=most: tiles.ragged_paged_tiles(
                **b, num_pairs=n, sm_scale=0.2, slice_pairs=most
            )
        )(bb)
        for most in SLICES
    ]
    assert outs[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(outs[0], np.float32), want, atol=3e-2, rtol=3e-2)
    ref = reference.ragged_paged_attention(**bb, sm_scale=0.2)
    assert np.mean(np.asarray(outs[0] != ref)) < 0.02  # one bf16 ulp here and there (rounding.py)
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))
    # bf16 dot operands (the caches hold bf16 values): the same products, summed in another order.
    narrow = jax.jit(
        lambda b: tiles.ragged_paged_tiles(**b, num_pairs=n, sm_scale=0.2, narrow_dots=True)
    )(bb)
    assert narrow.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(narrow, np.float32), want, atol=3e-2, rtol=3e-2)
    assert np.mean(np.asarray(narrow != outs[0])) < 0.02


def test_too_few_pairs_give_nan_not_a_truncated_answer():
    """The host's count is what the device enumerates: one pair fewer breaks the promise."""
    rng = np.random.default_rng(4)
    for ql, kl, *_, bs, _sw, _sc, _ps, _pt in (CASES[0], CASES[2]):
        b = case_batch(rng, ql, kl, 4, 2, 16, bs, 0, 0, poison=False)
        need = tiles.tile_chunks(zip(ql, kl, strict=True), bs)
        assert np.isfinite(np.asarray(_tiles(b, need, sm_scale=0.25))).all()
        assert np.isnan(np.asarray(_tiles(b, need - 1, sm_scale=0.25))).all()


def test_host_count_and_its_bound():
    """A tile of TILE_QUERIES queries reaches the chunk of its last query; the bound of a step's
    padded shapes covers every tile at the widest table."""
    c = tiles.TILE_QUERIES
    keys = 128  # block size 16: 8 blocks a chunk
    assert tiles.tile_chunks([(1, 1)], 16) == 1
    assert tiles.tile_chunks([(1, keys + 1)], 16) == 2
    # One prompt of 2c tokens after keys cached: tiles end at keys + c - 1 and keys + 2c - 1.
    assert tiles.tile_chunks([(2 * c, keys + 2 * c)], 16) == 2 + 2
    assert tiles.tile_chunks([], 16) == 0
    assert tiles.max_tile_chunks(2048, 64, 64, 16) == (2048 // c + 64) * 8


def test_dispatcher_routes_tiles_and_sends_prefix_lens_to_the_reference(monkeypatch):
    # Where the C++ kernel serves f32 steps (test_rpa_native.py) the dispatcher takes it instead.
    monkeypatch.setattr(native, "library", lambda kind, head_dim=None: None)
    rng = np.random.default_rng(5)
    ql, kl = [30, 1, 12], [50, 90, 12]
    b = case_batch(rng, ql, kl, 8, 2, 16, 8, 2, 2)
    n = tiles.tile_chunks(zip(ql, kl, strict=True), 8)
    prefix = jnp.asarray([40, 3, 12, 0, 0], jnp.int32)

    @jax.jit
    def calls(b):
        plain = ragged_paged_attention(**b, sm_scale=0.25)
        tiled = ragged_paged_attention(**b, sm_scale=0.25, tile_chunks=n)
        short = ragged_paged_attention(**b, sm_scale=0.25, tile_chunks=n - 1)
        prefix_ref = ragged_paged_attention(**b, sm_scale=0.25, prefix_lens=prefix)
        prefix_tiled = ragged_paged_attention(
            **b, sm_scale=0.25, prefix_lens=prefix, tile_chunks=n - 1
        )
        return plain, tiled, short, prefix_ref, prefix_tiled

    plain, tiled, short, prefix_ref, prefix_tiled = calls(as_jnp(b))
    np.testing.assert_allclose(tiled, plain, atol=2e-6, rtol=2e-5)
    assert np.isnan(np.asarray(short)).all()  # the tiles served it (and saw the short count)
    np.testing.assert_array_equal(np.asarray(prefix_tiled), np.asarray(prefix_ref))
    try:
        ragged_paged_attention(**as_jnp(b), sm_scale=0.25, tile_chunks=n, decode_chunks=3)
    except ValueError as err:
        assert "not both" in str(err)
    else:
        raise AssertionError("decode_chunks with tile_chunks was accepted")
