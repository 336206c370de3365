"""DeepSeek-V3.2 (DSA) against HF transformers: the lightning indexer module on HF's weights over a
paged, chunked, prefix-shared batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import RopeConfig
from model.layers.dsa_indexer import Indexer
from model.layers.rotary import rotary_cos_sin
from model.testing import SeqChunk, make_batch

BLOCK = 4


def _torch_rope(rope_dim, positions, theta=10000.0):
    """HF's cos/sin (cat(freqs, freqs)) for the given positions, [1, S, rope_dim]."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
    freqs = torch.tensor(positions, dtype=torch.float)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos(), emb.sin()


@pytest.fixture(scope="module")
def hf_indexer():
    import torch
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    cfg = hf.DeepseekV32Config(
        hidden_size=48,
        q_lora_rank=24,
        index_n_heads=8,
        index_head_dim=32,
        qk_rope_head_dim=16,
        index_topk=6,
    )
    torch.manual_seed(0)
    mod = hf.DeepseekV32Indexer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        mod.k_norm.weight.add_(1.0)
    return cfg, mod


def _our_indexer(cfg, mod) -> Indexer:
    ours = Indexer(
        hidden_size=cfg.hidden_size,
        q_lora_rank=cfg.q_lora_rank,
        num_heads=cfg.index_n_heads,
        head_dim=cfg.index_head_dim,
        rope_dim=cfg.qk_rope_head_dim,
        topk=cfg.index_topk,
        dtype=jnp.float32,
    )
    for name in ("wq_b", "wk", "weights_proj"):
        getattr(ours, name).kernel[...] = jnp.asarray(getattr(mod, name).weight.detach().numpy().T)
    ours.k_norm.weight[...] = jnp.asarray(mod.k_norm.weight.detach().numpy())
    ours.k_norm.bias[...] = jnp.asarray(mod.k_norm.bias.detach().numpy())
    return ours


def test_indexer_selects_hf_top_k_over_paged_chunked_and_shared_contexts(hf_indexer):
    """Sequences A (29 tokens), B (13), C (6) run in three steps of chunked prefill and decode;
    D starts with A's first 8 tokens and reads their keys from A's blocks (a prefix hit). Every
    token's selection equals HF's indexer over the whole sequence with a causal mask."""
    import torch

    cfg, mod = hf_indexer
    ours = _our_indexer(cfg, mod)
    rng = np.random.default_rng(1)
    inputs = {
        s: (rng.standard_normal((n, cfg.hidden_size)), rng.standard_normal((n, cfg.q_lora_rank)))
        for s, n in (("A", 29), ("B", 13), ("C", 6), ("D", 15))
    }
    inputs["D"] = tuple(
        np.concatenate([a[:8], d[8:]]) for a, d in zip(inputs["A"], inputs["D"], strict=True)
    )
    tables = {"A": tuple(range(1, 9)), "B": (12, 10, 9, 11), "C": (14, 13), "D": (1, 2, 15, 16)}
    steps = [
        [("A", 0, 13), ("B", 0, 12), ("C", 0, 5)],
        [("A", 13, 28), ("B", 12, 13), ("C", 5, 6)],
        [("A", 28, 29), ("D", 8, 15)],
    ]
    rope = RopeConfig("default", 10000.0, cfg.qk_rope_head_dim, 256)

    @jax.jit
    def step(cache, x, q_latent, batch):
        cos, sin = rotary_cos_sin(batch.positions, rope, jnp.float32)
        return ours(x, q_latent, cos, sin, cache, batch)

    cache = (jnp.zeros((20, BLOCK, 1, cfg.index_head_dim), jnp.float32),)
    got = {s: {} for s in inputs}
    for chunks in steps:
        batch = make_batch(
            [SeqChunk(tuple(range(a, b)), a, tables[s]) for s, a, b in chunks],
            BLOCK,
            num_tokens=32,
            num_seqs=4,
            max_blocks=8,
        )
        x = np.zeros((32, cfg.hidden_size), np.float32)
        ql = np.zeros((32, cfg.q_lora_rank), np.float32)
        row = 0
        for s, a, b in chunks:
            x[row : row + b - a] = inputs[s][0][a:b]
            ql[row : row + b - a] = inputs[s][1][a:b]
            row += b - a
        selected, cache = step(cache, jnp.asarray(x), jnp.asarray(ql), batch)
        selected = np.asarray(selected)
        assert selected.shape == (32, cfg.index_topk) and selected.dtype == np.int32
        row = 0
        for s, a, b in chunks:
            for p in range(a, b):
                got[s][p] = selected[row]
                row += 1

    for s, (x, ql) in inputs.items():
        n = x.shape[0]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
        with torch.no_grad():
            want = mod(
                torch.tensor(x[None], dtype=torch.float32),
                torch.tensor(ql[None], dtype=torch.float32),
                _torch_rope(cfg.qk_rope_head_dim, list(range(n))),
                causal,
                position_ids=None,
            )[0].numpy()
        for p, ids in got[s].items():
            k = min(p + 1, cfg.index_topk)
            # HF lets masked (future) positions fill a short top-k; ours pads with -1.
            assert set(ids[:k].tolist()) == set(want[p, :k].tolist()), (s, p, ids, want[p])
            assert (ids[k:] == -1).all(), (s, p, ids)
