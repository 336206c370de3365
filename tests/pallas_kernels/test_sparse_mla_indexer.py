"""Lightning indexer top-k vs a direct numpy computation, and vs HF deepseek_v32's indexer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_mla_decode import indexer_topk


def numpy_topk(q, k, w, topk, limits):
    """Scores in float64; allowed ids ordered by (score desc, id asc), then -1 padding."""
    scores = np.einsum("th,ths->ts", w, np.maximum(np.einsum("thd,sd->ths", q, k), 0.0))
    out = np.full((q.shape[0], topk), -1, np.int32)
    for t, n in enumerate(limits):
        allowed = np.arange(min(max(n, 0), k.shape[0]))
        order = allowed[np.lexsort((allowed, -scores[t, allowed]))][:topk]
        out[t, : len(order)] = order
    return out


_jit_topk = jax.jit(indexer_topk, static_argnums=3)


def test_integer_scores_with_ties_and_causal_limits():
    # Small integers make every score exact in f32 and produce many ties.
    rng = np.random.default_rng(0)
    T, H, D, S = 9, 4, 16, 40
    q = rng.integers(-2, 3, (T, H, D)).astype(np.float32)
    k = rng.integers(-2, 3, (S, D)).astype(np.float32)
    k[5] = k[17] = k[3]  # identical keys: guaranteed ties
    w = rng.integers(-1, 3, (T, H)).astype(np.float32)
    limits = np.array([0, 1, 3, 6, 7, 20, 40, 55, 18], np.int32)  # 0, fewer than topk, > S
    for topk in (1, 6, 8, 50):
        got = np.asarray(_jit_topk(*map(jnp.asarray, (q, k, w)), topk, jnp.asarray(limits)))
        assert got.dtype == np.int32 and got.shape == (T, topk)
        np.testing.assert_array_equal(got, numpy_topk(q, k, w, topk, limits), err_msg=f"{topk}")
    assert (got[0] == -1).all() and (got[2, 3:] == -1).all()


def test_random_float_scores_pick_the_top_set():
    rng = np.random.default_rng(1)
    T, H, D, S, topk = 5, 8, 32, 300, 64
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k = rng.standard_normal((S, D)).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    limits = np.array([300, 64, 63, 150, 2], np.int32)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, w)]
    for args, exact in (((q, k, w), True), (bf16, False)):
        got = np.asarray(_jit_topk(*map(jnp.asarray, args), topk, jnp.asarray(limits)))
        want = numpy_topk(*(np.asarray(a, np.float64) for a in args), topk, limits)
        if exact:
            np.testing.assert_array_equal(got, want)
        else:  # bf16 inputs, f32 math: same sets, order may differ only between near-ties
            for g, r in zip(got, want, strict=True):
                assert set(g.tolist()) == set(r.tolist())


def test_matches_hf_deepseek_v32_indexer():
    import torch
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    cfg = hf.DeepseekV32Config(
        hidden_size=64,
        q_lora_rank=32,
        index_n_heads=4,
        index_head_dim=32,
        qk_rope_head_dim=16,
        index_topk=8,
    )
    torch.manual_seed(0)
    mod = hf.DeepseekV32Indexer(cfg, layer_idx=0).eval()
    B, S = 1, 13
    x = torch.randn(B, S, cfg.hidden_size)
    q_resid = torch.randn(B, S, cfg.q_lora_rank)
    # Identity rotary (cos 1, sin 0) keeps the comparison to the scoring and the top-k.
    rot = (torch.ones(B, S, cfg.qk_rope_head_dim), torch.zeros(B, S, cfg.qk_rope_head_dim))
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))[None]
    want = mod(x, q_resid, rot, causal, position_ids=None).numpy()[0]  # [S, min(topk, S)]

    with torch.no_grad():
        q = mod.wq_b(q_resid).view(S, cfg.index_n_heads, cfg.index_head_dim)
        k = mod.k_norm(mod.wk(x))[0]
        w = mod.weights_proj(x)[0] * cfg.index_n_heads**-0.5 * mod.softmax_scale
    limits = jnp.arange(1, S + 1, dtype=jnp.int32)
    got = np.asarray(_jit_topk(*(jnp.asarray(a.numpy()) for a in (q, k, w)), 8, limits))
    for t in range(S):
        n = min(t + 1, 8)
        # HF lets masked positions fill a short top-k; those are -1 here. torch.topk orders ties
        # (ReLU makes exact zeros common) arbitrarily, so compare the chosen sets.
        assert set(got[t, :n].tolist()) == set(want[t, :n].tolist()), f"row {t}"
        assert (got[t, n:] == -1).all()


def test_lowers_for_cuda_and_rocm_at_production_shape():
    sds = jax.ShapeDtypeStruct
    T, H, D, S = 64, 64, 128, 131072
    args = (sds((T, H, D), jnp.bfloat16), sds((S, D), jnp.bfloat16), sds((T, H), jnp.float32))
    f = functools.partial(indexer_topk, topk=2048)
    for plat in ("cuda", "rocm"):
        lowered = jax.jit(f).trace(*args, causal_limits=sds((T,), jnp.int32))
        assert "topk" in lowered.lower(lowering_platforms=(plat,)).as_text().lower()


def test_bad_arguments_name_the_value():
    q, k, w = jnp.ones((2, 3, 8)), jnp.ones((10, 8)), jnp.ones((2, 3))
    lim = jnp.array([1, 2], jnp.int32)
    for args, match in (
        ((q[0], k, w, 4, lim), "q_idx must be"),
        ((q, k[:, :4], w, 4, lim), "k_idx must be"),
        ((q, k, w[:, :2], 4, lim), "weights must be"),
        ((q, k, w, 0, lim), "topk must be"),
        ((q, k, w, 4, lim.astype(jnp.float32)), "causal_limits must be"),
    ):
        with pytest.raises(ValueError, match=match):
            indexer_topk(*args)
