"""The encoder's CPU paths (the C++ prefill kernel for f32, the per-sequence loop otherwise)
against the padded layout through the flash-attention reference on ragged batches: many shapes in
one test (bidirectional and causal, grouped key/value heads, lengths 1 to the window, padding
sequences and padding tokens), and the scenario the loop must keep from breaking: a non-finite
value in one sequence's rows (or in the batch padding after the last one) never reaches another
sequence's output, although windows overlap the next sequence's rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.layers.encoder_attention import (
    _padded_attention,
    choose_backend,
    native_attention,
    ragged_self_attention,
    sequence_loop_attention,
)
from pallas_kernels.ragged_paged_attention import native

HEADS, DIM = 4, 16
REFERENCE = choose_backend(
    num_heads=HEADS, head_dim=DIM, dtype=jnp.float32, causal=False, impl="reference"
)
# Every batch padded to one shape (one compilation per variant): 8 sequence rows, 128 tokens, a
# window of 48. Lengths 1 and 48 are the edges; the last batch's windows reach past the batch.
NUM_PADDED, NUM_TOKENS, WINDOW = 8, 128, 48
BATCHES = [[1], [5, 17, 3, 40], [48, 48], [30, 1, 29, 2, 31, 1, 2, 3], [40, 48, 39]]


def _cu(lengths, num_padded):
    cu = np.zeros(num_padded + 1, np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    return jnp.asarray(cu)


def _loop(q, k, v, cu, n, *, window, causal):
    fn = jax.jit(sequence_loop_attention, static_argnames=("max_len", "causal", "sm_scale"))
    return fn(q, k, v, cu, n, max_len=window, causal=causal, sm_scale=DIM**-0.5)


def _padded(q, k, v, cu, *, window, causal):
    fn = jax.jit(_padded_attention, static_argnames=("max_len", "causal", "sm_scale", "backend"))
    return fn(q, k, v, cu, max_len=window, causal=causal, sm_scale=DIM**-0.5, backend=REFERENCE)


def _native(q, k, v, cu, n, *, window, causal):
    fn = jax.jit(native_attention, static_argnames=("max_len", "causal", "sm_scale"))
    return fn(q, k, v, cu, n, max_len=window, causal=causal, sm_scale=DIM**-0.5)


def test_loop_and_native_kernel_match_padded_layout_on_ragged_batches():
    """The loop and the C++ prefill kernel over the step's tokens as one-token pages
    (native_attention) give the padded layout's results; the kernel's padding rows are zero."""
    assert native.available(DIM)  # CI installs a compiler (.ci/run)
    rng = np.random.default_rng(0)
    for causal in (False, True):
        for kv_heads in (HEADS, 1):
            for lengths in BATCHES:
                q = jnp.asarray(rng.standard_normal((NUM_TOKENS, HEADS, DIM)), jnp.float32)
                k, v = (
                    jnp.asarray(rng.standard_normal((NUM_TOKENS, kv_heads, DIM)), jnp.float32)
                    for _ in range(2)
                )
                cu = _cu(lengths, NUM_PADDED)
                got = _loop(q, k, v, cu, jnp.int32(len(lengths)), window=WINDOW, causal=causal)
                want = _padded(q, k, v, cu, window=WINDOW, causal=causal)
                real = sum(lengths)
                case = (causal, kv_heads, lengths)
                assert got.shape == q.shape, case
                np.testing.assert_allclose(got[:real], want[:real], rtol=2e-5, atol=2e-6)
                assert bool(jnp.all(jnp.isfinite(got))), case
                fast = _native(q, k, v, cu, jnp.int32(len(lengths)), window=WINDOW, causal=causal)
                np.testing.assert_allclose(fast[:real], want[:real], rtol=2e-5, atol=2e-6)
                assert bool(jnp.all(fast[real:] == 0)), case


def test_dispatch_takes_the_native_kernel_in_f32_for_every_float_dtype():
    rng = np.random.default_rng(1)
    cu, n = _cu([9, 20, 3], NUM_PADDED), jnp.int32(3)
    shape = (WINDOW, HEADS, DIM)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    fn = jax.jit(
        ragged_self_attention, static_argnames=("max_len", "causal", "sm_scale", "backend")
    )
    kw = dict(max_len=64, causal=False, sm_scale=DIM**-0.5, backend=REFERENCE)
    assert native.KERNELS["prefill"][2] in fn.lower(q, k, v, cu, n, **kw).as_text()
    got = fn(q, k, v, cu, n, **kw)
    # The window is the smaller of max_len and the batch's token count.
    want = _loop(q, k, v, cu, n, window=WINDOW, causal=False)
    np.testing.assert_allclose(got[:32], want[:32], rtol=2e-5, atol=2e-6)
    # A bf16 or f16 encoder: the kernel in f32, as the loop computes, the result cast back.
    for dtype, tol in ((jnp.bfloat16, 2**-7), (jnp.float16, 2**-10)):
        narrow = [x.astype(dtype) for x in (q, k, v)]
        assert native.KERNELS["prefill"][2] in fn.lower(*narrow, cu, n, **kw).as_text()
        got = fn(*narrow, cu, n, **kw)
        assert got.dtype == dtype
        want = _loop(*narrow, cu, n, window=WINDOW, causal=False)
        np.testing.assert_allclose(
            np.asarray(got[:32], np.float32), np.asarray(want[:32], np.float32), rtol=tol, atol=tol
        )


def test_non_finite_values_stay_in_their_sequence():
    # Sequence 1's window of 48 covers sequence 2's rows and the batch padding; both hold inf and
    # NaN in k and v. A masked key's weight is 0, and 0 * inf would be NaN without the zeroing.
    rng = np.random.default_rng(2)
    cu = _cu([10, 12], NUM_PADDED)
    shape = (NUM_TOKENS, HEADS, DIM)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    k = k.at[12].set(jnp.inf).at[30].set(jnp.nan)
    v = v.at[15].set(jnp.inf).at[35].set(jnp.nan)
    got = _loop(q, k, v, cu, jnp.int32(2), window=WINDOW, causal=False)
    clean_k, clean_v = k.at[10:].set(0.0), v.at[10:].set(0.0)
    alone = _loop(
        q, clean_k, clean_v, _cu([10], NUM_PADDED), jnp.int32(1), window=WINDOW, causal=False
    )
    assert bool(jnp.all(jnp.isfinite(got[:10])))
    np.testing.assert_allclose(got[:10], alone[:10], rtol=1e-6, atol=1e-7)
    # The native kernel reads only each sequence's own rows.
    native_got = _native(q, k, v, cu, jnp.int32(2), window=WINDOW, causal=False)
    np.testing.assert_allclose(native_got[:10], alone[:10], rtol=2e-5, atol=2e-6)
