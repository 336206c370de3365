"""DeepSeek-V3 (MLA, dense and MoE layers) against HF transformers' deepseek_v3.

Module level: logits of ragged mixed steps (chunked prefill, decode, a prefix read from another
sequence's blocks) against HF's full forward; MLA's `selected` hook (DeepSeek-V3.2's) against a
numpy oracle of the expanded attention. Engine level (`LLM`): greedy tokens identical to HF
`generate` and logprobs close, with chunked prefill, shared-prefix hits and a pool small enough to
preempt, and once without chunking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ModelConfig
from model.deepseek import DeepseekV3ForCausalLM
from model.layers import compute
from model.layers.mla import MLAttention, softmax_scale
from model.layers.rotary import rotary_cos_sin
from model.loader import load_model
from model.testing import (
    SeqChunk,
    check_logprobs_close,
    hf_greedy,
    hf_load,
    hf_logits,
    make_batch,
    run_schedule,
    scattered_block_tables,
    write_tiny_checkpoint,
)
from pallas_kernels import backends
from vlax import LLM, SamplingParams

BLOCK = 4
T, S, MB = 32, 5, 8  # one padded shape for every module-level step: each model compiles once
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.7}  # fmt: skip
CASES = {
    # q_lora set, interleaved rope (HF's default layout); layer 0 dense, layer 1 MoE (4 experts
    # top-2 in one group, a shared expert)
    "lora_k1": dict(first_k_dense_replace=1),
    # q_proj without lora; every layer MoE, 8 experts in 4 groups of which 2 are kept; YaRN with
    # mscale != mscale_all_dim (a softmax-scale factor and a cos/sin factor); biases on q/kv/o
    "nolora_k0_groups_yarn": dict(
        q_lora_rank=None,
        first_k_dense_replace=0,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        attention_bias=True,
        rope_parameters=YARN,
    ),
    # half-split rope (rope_interleave false), tied embeddings, every layer dense
    "halfsplit_tied_dense": dict(
        rope_interleave=False, tie_word_embeddings=True, first_k_dense_replace=2
    ),
}
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _prompts(seed: int, lengths, prefix_len: int = 0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 128, prefix_len).tolist()
    return [prefix + rng.integers(3, 128, n).tolist() for n in lengths]


# Different lengths, a shared 12-token prefix (three blocks) for prefix-cache hits.
PROMPTS = _prompts(10, [3, 17, 30, 9, 1], prefix_len=12)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {
        name: write_tiny_checkpoint(root / name, "deepseek_v3", seed=i, **ov)
        for i, (name, ov) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {name: hf_load(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def hf_reference(hf_models):
    """Per case: HF's greedy tokens and top-5 logprobs for PROMPTS, and its uncached argmax."""
    out = {}
    for name, model in hf_models.items():
        rows = []
        for p in PROMPTS:
            toks = hf_greedy(model, p, MAX_TOKENS)
            logits = hf_logits(model, p + toks)[len(p) - 1 : -1]
            lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            top = np.argsort(-lp, axis=-1)[:, :5]
            rows.append(
                (
                    toks,
                    [{int(t): float(lp[i, t]) for t in top[i]} for i in range(len(toks))],
                    logits.argmax(-1).tolist(),
                )
            )
        out[name] = rows
    return out


def test_hf_cached_generate_agrees_with_its_uncached_argmax(hf_reference):
    # The oracle first: random tiny weights can make near-ties that HF's own cached and uncached
    # paths break differently; then a mismatch below would not be vlax's.
    for name, rows in hf_reference.items():
        for toks, _, argmax in rows:
            assert toks == argmax, name


FORWARD = jax.jit(base.forward, donate_argnums=2)
LOGITS = jax.jit(base.compute_logits)
OPTIONS = ModelOptions(block_size=BLOCK)


def _ragged_logits(graphdef, state, tokens, jitted=(FORWARD, LOGITS)):
    """{seq: {position: logits}} over a 3-step mixed schedule (run by the `jitted` forward and
    logits functions):

    step 1: A prefill 0..13, B prefill 0..7, D prefill 0..5
    step 2: A prefill 13..23 (over its cached chunk), B decode, C prefill 0..17, D decode
    step 3: decodes of A, B, C, D, and E prefill 12..20, whose first 12 tokens are A's: E's table
            starts with A's first three blocks, so it reads K/V it never computed (a prefix hit)
    """
    model = nnx.merge(graphdef, state)
    caches = base.allocate(type(model).cache_specs(model.config, OPTIONS), 40)
    tables = dict(zip("ABCD", scattered_block_tables([25, 10, 19, 8], BLOCK, seed=3), strict=True))
    tables["E"] = tables["A"][:3] + (33, 34)
    steps = [
        [("A", 0, 13), ("B", 0, 7), ("D", 0, 5)],
        [("A", 13, 23), ("B", 7, 8), ("C", 0, 17), ("D", 5, 6)],
        [("A", 23, 24), ("B", 8, 9), ("C", 17, 18), ("D", 6, 7), ("E", 12, 20)],
    ]
    _, got = run_schedule(
        *jitted,
        graphdef,
        state,
        caches,
        tokens,
        tables,
        steps,
        BLOCK,
        num_tokens=T,
        num_seqs=S,
        max_blocks=MB,
    )
    return got


def _ragged_tokens(seed):
    rng = np.random.default_rng(seed)
    tokens = {
        s: rng.integers(3, 128, n).tolist() for s, n in zip("ABCD", (24, 9, 18, 7), strict=True)
    }
    tokens["E"] = tokens["A"][:12] + rng.integers(3, 128, 8).tolist()
    return tokens


def _load(path, dtype="float32"):
    return load_model(path, ModelConfig.from_pretrained(path, dtype=dtype), OPTIONS)


def test_ragged_prefill_decode_and_prefix_logits_match_hf(checkpoints, hf_models):
    for i, (name, path) in enumerate(checkpoints.items()):
        tokens = _ragged_tokens(i)
        got = _ragged_logits(*_load(path), tokens)
        hf = hf_models[name]
        for s, toks in tokens.items():
            first = min(got[s])  # E computes from position 12
            want = hf_logits(hf, toks)[first:]
            ours = np.stack([got[s][p] for p in range(first, len(toks))])
            np.testing.assert_allclose(ours, want, atol=1e-4, rtol=1e-4, err_msg=f"{name} seq {s}")


def test_bfloat16_logits_close_to_hf_bfloat16(checkpoints):
    """As each kind of host computes bf16 (model/layers/compute.py): operands as they are (native
    bf16 dots), widened to f32 (AVX2), and with the dense weights kept in f32 too."""
    path = checkpoints["lora_k1"]
    tokens = _ragged_tokens(5)
    hf = hf_load(path, "bfloat16")
    want = {s: hf_logits(hf, toks) for s, toks in tokens.items()}
    before = compute.widening(), compute.wide_weights()
    try:
        for operands, weights in ((False, False), (True, False), (True, True)):
            compute.widen_bf16(operands, weights=weights)
            # Fresh functions: the layers read the choice when they are traced.
            jitted = jax.jit(base.forward, donate_argnums=2), jax.jit(base.compute_logits)
            got = _ragged_logits(*_load(path, "bfloat16"), tokens, jitted)
            first = {s: min(got[s]) for s in tokens}
            ours = np.concatenate(
                [[got[s][p] for p in range(first[s], len(t))] for s, t in tokens.items()]
            )
            theirs = np.concatenate([want[s][first[s] :] for s in tokens])
            rows, scale = np.abs(ours - theirs).max(-1), np.abs(theirs).max()
            # bf16 roundings differ (HF expands the latent per head, vlax absorbs W_UK / W_UV), and
            # where a token's router scores are that close, one side picks another expert: one
            # row may go further (measured: seq C's 2nd token, widened, 0.50 of a scale of 8).
            mode = (operands, weights)
            assert np.median(rows) < 0.02 * scale, (mode, np.median(rows), scale)
            assert np.sum(rows >= 0.05 * scale) <= 1, (mode, np.sort(rows)[-3:], scale)
    finally:
        compute.widen_bf16(before[0], weights=before[1])


def _ours(outs):
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
        )
        for o in outs
    ]


# Per case, how the engine schedules: the MoE cases with chunked prefill (a 16-token budget chunks
# the long prompts over several steps, mixed with decodes), the dense one without (whole prompts).
# Either way 16 usable blocks of 4 tokens cannot hold the five 13..50-token sequences, so requests
# are preempted and recomputed, and the shared 12-token prefix is read from the cache.
ENGINE_ARGS = {
    "lora_k1": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "nolora_k0_groups_yarn": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "halfsplit_tied_dense": dict(max_num_seqs=5, enable_chunked_prefill=False),
}


def test_engine_greedy_tokens_and_logprobs_match_hf(checkpoints, hf_reference):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, path in checkpoints.items():
        ref = [(toks, lps) for toks, lps, _ in hf_reference[name]]
        args = ENGINE_ARGS[name]
        llm = LLM(
            path,
            dtype="float32",
            max_model_len=64,
            block_size=BLOCK,
            num_kv_blocks=17,
            record_steps=None,
            **args,
        )
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref], name
        check_logprobs_close(_ours(outs), ref, atol=2e-3)
        engine = llm.engine
        if args.get("enable_chunked_prefill", True):
            assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.stats), name
        assert sum(s.num_preempted for s in engine.stats) > 0, name
        hits = [nd.num_computed_tokens for so in engine.history for nd in so.scheduled_new_reqs]
        assert max(hits) >= 12, name
        (spec,) = engine.runner.cache_specs
        assert (spec.name, spec.parts, spec.page_shape) == (
            "MLA latent",
            ("latent",),
            (BLOCK, 1, 24),
        )


def _expanded_oracle(attn: MLAttention, scale: float, x, allowed, cos, sin):
    """numpy MLA in HF's expanded form: per head K = [c W_UK | k_pe], V = c W_UV; token i of one
    sequence x [n, hidden] attends token j where allowed[i, j]."""
    s = attn.shape
    h = s.num_heads
    w = np.asarray(attn.kv_b_proj.weight[...]).T.reshape(s.kv_lora_rank, h, -1)
    q = attn.q_proj(x) if attn.q_proj is not None else attn.q_b_proj(attn.q_resid(x))
    q_nope = np.asarray(q).reshape(x.shape[0], h, -1)[..., : s.qk_nope_head_dim]
    _, q_pe = attn.project_q(x, cos, sin)
    lat = np.asarray(attn.project_latent(x, cos, sin))
    c, k_pe = lat[:, : s.kv_lora_rank], lat[:, s.kv_lora_rank :]
    k_nope = np.einsum("jr,rhn->jhn", c, w[..., : s.qk_nope_head_dim])
    v = np.einsum("jr,rhv->jhv", c, w[..., s.qk_nope_head_dim :])
    scores = np.einsum("ihn,jhn->hij", q_nope, k_nope)
    scores = scores + np.einsum("ihp,jp->hij", np.asarray(q_pe), k_pe)
    scores = scores * scale + np.where(allowed, 0.0, -np.inf)[None]
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    o = np.einsum("hij,jhv->ihv", p, v).reshape(x.shape[0], -1)
    return np.asarray(attn.o_proj(jnp.asarray(o, jnp.float32)))


def test_selected_positions_attend_only_those(checkpoints):
    """The DSA hook: per token, the positions it may attend (-1 none), over a ragged batch of a
    prefill chunk after a cached chunk and a fresh prefill; against the expanded-form oracle, and
    with every causal position selected, equal to dense attention."""
    path = checkpoints["nolora_k0_groups_yarn"]
    config = ModelConfig.from_pretrained(path, dtype="float32")
    model = nnx.merge(*load_model(path, config, OPTIONS))
    dense = model.model.layers[0].self_attn
    latent = dense.shape.latent_dim
    sparse = backends.select("sparse_mla_decode", dtype="float32", head_dim=latent, d_v=16)
    attn = MLAttention(config, 0, config.jnp_dtype, backend=dense.backend, sparse_backend=sparse)
    nnx.update(attn, nnx.state(dense))
    parts = nnx.split(attn)
    run = jax.jit(lambda parts, *args, selected: nnx.merge(*parts)(*args, selected=selected))
    hidden, rope = config.hidden_size, model.rope
    rng = np.random.default_rng(0)
    xa = jnp.asarray(rng.normal(size=(11, hidden)), jnp.float32)
    xb = jnp.asarray(rng.normal(size=(6, hidden)), jnp.float32)
    ta, tb = scattered_block_tables([11, 6], BLOCK, seed=1)
    shape = dict(num_tokens=16, num_seqs=2, max_blocks=4)

    def rows(*parts):
        x = jnp.zeros((16, hidden), jnp.float32)
        return x.at[: sum(len(p) for p in parts)].set(jnp.concatenate(parts))

    cache = base.allocate(type(model).cache_specs(config, OPTIONS), 8)[0]  # layer 0: (latent,)
    b1 = make_batch([SeqChunk((0,) * 5, 0, ta)], BLOCK, **shape)  # A's first 5 tokens, dense
    cs1 = rotary_cos_sin(b1.positions, rope, jnp.float32)
    _, cache = run(parts, rows(xa[:5]), *cs1, cache, b1, selected=None)
    # A 5..11 over its cached chunk, and B 0..6: each token with a random subset of its causal
    # positions, and a future position that must stay masked
    b2 = make_batch([SeqChunk((0,) * 6, 5, ta), SeqChunk((0,) * 6, 0, tb)], BLOCK, **shape)
    x2, cs2 = rows(xa[5:], xb), rotary_cos_sin(b2.positions, rope, jnp.float32)
    pos = np.asarray(b2.positions)
    selected = np.full((16, 5), -1, np.int32)
    every = np.full((16, 16), -1, np.int32)
    allowed = {"A": np.tril(np.ones((11, 11), bool)), "B": np.zeros((6, 6), bool)}
    for row in range(12):
        seq, i = ("A" if row < 6 else "B"), pos[row]
        pick = rng.permutation(i + 1)[: rng.integers(1, 5)]
        selected[row, : len(pick) + 1] = np.append(pick, i + 3)
        allowed[seq][i] = False
        allowed[seq][i, pick] = True
        every[row, : i + 1] = np.arange(i + 1)
    out, _ = run(parts, x2, *cs2, cache, b2, selected=jnp.asarray(selected))
    out_every, _ = run(parts, x2, *cs2, cache, b2, selected=jnp.asarray(every))
    out_dense, _ = run(parts, x2, *cs2, cache, b2, selected=None)
    np.testing.assert_allclose(np.asarray(out_every)[:12], np.asarray(out_dense)[:12], atol=1e-5)
    scale = softmax_scale(config)
    for seq, x, got, first in (("A", xa, out[:6], 5), ("B", xb, out[6:12], 0)):
        cs = rotary_cos_sin(jnp.arange(x.shape[0]), rope, jnp.float32)
        want = _expanded_oracle(attn, scale, x, allowed[seq], *cs)[first:]
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4, err_msg=seq)


# DeepSeek-V3's published config.json (less its fp8 quantization_config): no head_dim, the older
# `rope_scaling` + `rope_theta` form, and an MTP layer (num_nextn_predict_layers) on disk.
V3_HUB_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_published_v3_config_parses_with_hf_rope_and_softmax_scale():
    import torch
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

    from model.config import ConfigError, from_hf_dict
    from model.layers.mla import mla_rope
    from model.layers.rotary import inv_freq_and_scale

    config = from_hf_dict(V3_HUB_CONFIG, path="v3")
    (spec,) = DeepseekV3ForCausalLM.cache_specs(config, ModelOptions(block_size=64))
    assert (spec.name, spec.num_layers, spec.page_shape, spec.dtype) == (
        "MLA latent", 61, (64, 1, 576), "bfloat16"
    )  # fmt: skip
    assert spec.bytes_per_block == 61 * 64 * 576 * 2
    hf_config = transformers.DeepseekV3Config(**V3_HUB_CONFIG)
    with torch.device("meta"):
        hf_attn = hf_v3.DeepseekV3Attention(hf_config, 0)
    hf_rope = hf_v3.DeepseekV3RotaryEmbedding(hf_config)
    inv, cos_sin_factor = inv_freq_and_scale(mla_rope(config))
    np.testing.assert_array_equal(inv, hf_rope.inv_freq.numpy())
    assert cos_sin_factor == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    assert softmax_scale(config) == pytest.approx(hf_attn.scaling, rel=1e-12)
    assert softmax_scale(config) != pytest.approx(192**-0.5)  # YaRN's mscale is in it
    # The MTP layer after the last decoder layer is on disk but unused.
    assert DeepseekV3ForCausalLM.hf_ignored_weight("model.layers.61.eh_proj.weight", config)
    assert not DeepseekV3ForCausalLM.hf_ignored_weight("model.layers.60.mlp.gate.weight", config)
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        bad = from_hf_dict({**V3_HUB_CONFIG, key: None}, path="v3")
        with pytest.raises(ConfigError, match=f"'{key}' must be a positive int, got None"):
            DeepseekV3ForCausalLM.cache_specs(bad, ModelOptions())
