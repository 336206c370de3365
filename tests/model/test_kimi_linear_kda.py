"""The KDA layer (model/layers/kda.py) against a plain numpy recurrence of kernels.md A.1, token by
token, on random weights: both gate forms (the default and `gate_lower_bound`), sequences split
over steps as prefill chunks and single-token decodes, state slots reused after a reset, padding
rows and tokens. The layer's state must carry exactly what the one-pass recurrence carries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels.kda as kda_ops
from model.layers.kda import KDAShape, KimiDeltaAttention
from model.layers.short_conv import short_conv
from model.testing import SeqChunk, make_batch

H, K, D, W = 2, 16, 24, 4
SLOTS = 3


def _layer(bound, seed=0):
    shape = KDAShape(D, H, K, W, bound, 1e-5)
    q = jax.ShapeDtypeStruct((1, H, K), jnp.float32)
    layer = KimiDeltaAttention(
        shape,
        jnp.float32,
        prefill=kda_ops.select(kda_ops.PREFILL, q, q),
        decode=kda_ops.select(kda_ops.DECODE, q, q),
    )
    graphdef, state = nnx.split(layer)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        scale = 0.5 if path[-1] in ("A_log", "dt_bias", "o_norm") else 0.4
        value = rng.normal(0.0, scale, var.shape).astype(np.float32)
        flat.append((path, var.replace(jnp.asarray(value))))
    return graphdef, nnx.from_flat_state(flat)


def _numpy_layer(params, x, bound):
    """One sequence x [n, D] from zero state, one token at a time, in float64."""
    p = {".".join(map(str, k)): np.asarray(v[...], np.float64) for k, v in params}
    proj = x @ p["in_proj.weight"].T
    c = 3 * H * K
    mixed, f_a, g_a, b = proj[:, :c], proj[:, c : c + K], proj[:, c + K : c + 2 * K], proj[:, -H:]
    w = p["conv_weight"][:, 0]  # [W, C]
    padded = np.concatenate([np.zeros((W - 1, c)), mixed])
    conv = np.stack([(padded[t : t + W] * w).sum(0) for t in range(len(x))])
    conv = conv / (1 + np.exp(-conv))
    q, k, v = (a.reshape(-1, H, K) for a in np.split(conv, 3, axis=1))
    raw = (f_a @ p["f_b_proj.weight"].T).reshape(-1, H, K) + p["dt_bias"].reshape(H, K)
    rate = np.exp(p["A_log"].reshape(H))[:, None]
    g = -rate * np.log1p(np.exp(raw)) if bound is None else bound / (1 + np.exp(-rate * raw))
    beta = 1 / (1 + np.exp(-b))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * K**-0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    s = np.zeros((H, K, K))  # [head, key, value]
    out = []
    for t in range(len(x)):
        s = s * np.exp(g[t])[:, :, None]
        u = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(np.einsum("hkv,hk->hv", s, q[t]))
    o = np.stack(out)
    gate = (g_a @ p["g_b_proj.weight"].T).reshape(-1, H, K)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-5) * p["o_norm"]
    o = o / (1 + np.exp(-gate))
    return o.reshape(len(x), H * K) @ p["o_proj.weight"].T


@pytest.mark.parametrize("bound", [None, -5.0])
def test_layer_carries_state_across_steps_like_one_recurrence(bound):
    graphdef, params = _layer(bound)
    rng = np.random.default_rng(1)
    xs = {
        s: rng.normal(0, 1, (n, D)).astype(np.float32) for s, n in (("A", 19), ("B", 7), ("C", 5))
    }
    # (seq, start, end, slot, reset). B starts with one token (decode path, fresh slot); step 2 is
    # decode only; C takes B's slot after B finished, reset.
    schedule = [
        [("A", 0, 10, 2, True), ("B", 0, 1, 0, True)],
        [("A", 10, 11, 2, False), ("B", 1, 2, 0, False)],
        [("B", 2, 7, 0, False), ("A", 11, 19, 2, False)],
        [("C", 0, 2, 0, True)],
        [("C", 2, 3, 0, False)],
        [("C", 3, 5, 0, False)],
    ]

    @jax.jit
    def run(params, state, batch, x):
        return nnx.merge(graphdef, params)(x, state, batch)

    # NaN everywhere: a reset must clear whatever a slot's previous owner left.
    state = (
        jnp.full((SLOTS + 1, H, K, K), jnp.nan, jnp.float32),
        jnp.full((SLOTS + 1, W - 1, 3 * H * K), jnp.nan, jnp.float32),
    )
    got = {s: np.zeros((len(x), D)) for s, x in xs.items()}
    for step in schedule:
        batch = make_batch(
            [SeqChunk(tuple([5] * (b - a)), a, (1, 2)) for _, a, b, _, _ in step],
            16,
            num_tokens=24,
            num_seqs=4,
            state_slots=[c[3] for c in step],
            state_reset=[c[4] for c in step],
            scratch_slot=SLOTS,
        )
        x = np.zeros((24, D), np.float32)
        x[: sum(b - a for _, a, b, _, _ in step)] = np.concatenate(
            [xs[s][a:b] for s, a, b, _, _ in step]
        )
        out, state = run(params, state, batch, jnp.asarray(x))
        start = 0
        for s, a, b, _, _ in step:
            got[s][a:b] = np.asarray(out[start : start + b - a])
            start += b - a
    for s, x in xs.items():
        want = _numpy_layer(nnx.to_flat_state(params), x.astype(np.float64), bound)
        np.testing.assert_allclose(got[s], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_short_conv_continues_from_tails_and_keeps_empty_rows():
    rng = np.random.default_rng(2)
    c = 3
    x = rng.normal(size=(9, c)).astype(np.float32)
    w = rng.normal(size=(W, c)).astype(np.float32)
    tails = rng.normal(size=(3, W - 1, c)).astype(np.float32)
    cu = jnp.array([0, 2, 2, 9], jnp.int32)  # rows of 2, 0 and 7 tokens
    out, new = short_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tails), cu)
    for row, (a, b) in enumerate(((0, 2), (2, 2), (2, 9))):
        full = np.concatenate([tails[row], x[a:b]])
        want = [(full[t : t + W] * w).sum(0) for t in range(b - a)]
        np.testing.assert_allclose(np.asarray(out[a:b]), np.reshape(want, (-1, c)), rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(new[row]), full[-(W - 1) :])
