"""DeepSeek-V3 MoE: the router against a numpy oracle (ties, groups), the whole layer against HF's
DeepseekV3MoE on the same weights, loaded from a `save_pretrained` checkpoint's per-expert tensors."""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import registry
from model.config import ConfigError, ModelConfig, from_hf_dict
from model.layers.grouped_experts import expert_mlp, tile_rows
from model.layers.moe import DeepseekMoE, moe_weight_specs, route
from model.loader import load_model
from model.weight_spec import WeightSpec

ARCH = "MoeLayersOnlyForTest"
HIDDEN, INTER, EXPERTS = 32, 16, 8
TINY = dict(
    vocab_size=64,
    hidden_size=HIDDEN,
    intermediate_size=48,
    moe_intermediate_size=INTER,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=EXPERTS,
    n_shared_experts=2,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,
)


def oracle_route(logits, bias, *, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """numpy, one token at a time; ties go to the lower index (stable sort on the negated score)."""
    logits = np.asarray(logits, np.float32)
    scores = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
    choice = scores + np.asarray(bias, np.float32)
    per_group = logits.shape[1] // n_group
    all_ids, all_weights = [], []
    for row, score in zip(choice, scores, strict=True):
        groups = row.reshape(n_group, per_group)
        group_score = np.array([np.sort(g)[::-1][:2].sum(dtype=np.float32) for g in groups])
        kept = np.argsort(-group_score, kind="stable")[:topk_group]
        allowed = np.zeros(len(row), bool)
        for g in kept:
            allowed[g * per_group : (g + 1) * per_group] = True
        masked = np.where(allowed, row, -np.inf)
        ids = np.argsort(-masked, kind="stable")[:top_k]
        w = score[ids]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        all_ids.append(ids)
        all_weights.append(w * np.float32(scaling))
    return np.array(all_ids), np.array(all_weights, np.float32)


def _route(logits, bias, **kw):
    ids, weights = jax.jit(route, static_argnames=tuple(kw))(
        jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), **kw
    )
    return np.asarray(ids), np.asarray(weights)


def _check_route(logits, bias, *, top_k, n_group, topk_group, norm_topk_prob, scaling):
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    ids, weights = _route(logits, bias, routed_scaling_factor=scaling, **kw)
    want_ids, want_weights = oracle_route(logits, bias, scaling=scaling, **kw)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)
    return ids


def test_route_matches_the_numpy_oracle_on_random_scores():
    rng = np.random.default_rng(0)
    cases = [  # (experts, top_k, n_group, topk_group, norm_topk_prob, scaling)
        (16, 4, 4, 2, True, 2.5),
        (16, 4, 4, 2, False, 1.0),
        (12, 2, 1, 1, True, 1.5),
        (32, 8, 8, 3, True, 2.5),
        (8, 4, 2, 1, False, 0.5),  # top_k equals the experts in the one kept group
    ]
    for experts, top_k, n_group, topk_group, norm, scaling in cases:
        logits = rng.normal(0, 2, (97, experts))
        bias = rng.uniform(-0.3, 0.3, experts)
        ids = _check_route(
            logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=norm, scaling=scaling,
        )  # fmt: skip
        # Every chosen expert lies in one of topk_group groups.
        assert (np.array([len(set(r)) for r in ids // (experts // n_group)]) <= topk_group).all()


def test_group_limit_and_bias_change_the_choice():
    """Guards the oracle comparison against a router that ignores groups or the bias: both change
    which experts are chosen on random scores, and the bias never enters the weights."""
    rng = np.random.default_rng(1)
    logits, bias = rng.normal(0, 2, (200, 16)), rng.uniform(-0.5, 0.5, 16)
    kw = dict(top_k=4, norm_topk_prob=False, routed_scaling_factor=1.0)
    grouped, w = _route(logits, bias, n_group=4, topk_group=2, **kw)
    ungrouped, _ = _route(logits, bias, n_group=4, topk_group=4, **kw)
    unbiased, _ = _route(logits, np.zeros(16), n_group=4, topk_group=2, **kw)
    assert (np.sort(grouped) != np.sort(ungrouped)).any(axis=1).sum() > 20
    assert (np.sort(grouped) != np.sort(unbiased)).any(axis=1).sum() > 20
    sigmoid = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(w, np.take_along_axis(sigmoid, grouped, 1), rtol=1e-6)


def test_route_ties_go_to_the_lower_index():
    """Exact ties between experts and between groups: logits from a 3-value set, biases from a
    2-value set. The rule is jax.lax.top_k's (lower index first); torch's CPU topk has none."""
    rng = np.random.default_rng(2)
    logits = rng.choice([-0.5, 0.0, 0.5], size=(300, 16))
    bias = rng.choice([0.0, 0.25], size=16)
    for n_group, topk_group in ((4, 2), (8, 3), (1, 1)):
        _check_route(
            logits, bias, top_k=4, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=True, scaling=2.5,
        )  # fmt: skip
    # All equal: experts 0..k-1, from the lowest-indexed groups.
    ids, weights = _route(
        np.zeros((3, 16)), np.zeros(16), top_k=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=3.0,
    )  # fmt: skip
    np.testing.assert_array_equal(ids, [[0, 1, 2]] * 3)
    np.testing.assert_allclose(weights, 1.0, rtol=1e-6)
    # Groups 1 and 3 tie on their best two (0.9 + 0.8) and beat the others; group 1 wins.
    row = np.full(16, -3.0)
    row[[5, 6, 13, 14]] = [0.9, 0.8, 0.8, 0.9]
    ids, _ = _route(
        row[None], np.zeros(16), top_k=2, n_group=4, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0,
    )  # fmt: skip
    np.testing.assert_array_equal(ids, [[5, 6]])


def test_grouped_experts_match_a_per_pair_oracle():
    """The tile layout under routings that stress it: one token, all pairs on one expert (the
    most padding), every expert used, a skewed split, pair counts not a multiple of the tile."""
    rng = np.random.default_rng(5)
    experts, hidden, inter, top_k = 6, 16, 8, 2
    gate_up = rng.normal(0, 0.3, (experts, hidden, 2 * inter)).astype(np.float32)
    down = rng.normal(0, 0.3, (experts, inter, hidden)).astype(np.float32)

    def oracle(x, ids, weights):
        out = np.zeros(x.shape, np.float64)
        for t, k in np.ndindex(ids.shape):
            h = x[t].astype(np.float64) @ gate_up[ids[t, k]]
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            out[t] += weights[t, k] * (act @ down[ids[t, k]])
        return out

    run = jax.jit(expert_mlp)
    routings = {
        "one token": rng.choice(experts, (1, top_k), replace=False),
        "all on expert 4": np.stack([[4, 1]] * 40),
        "every expert": rng.integers(0, experts, (37, top_k)),
        "skewed": np.where(rng.random((133, top_k)) < 0.9, 0, rng.integers(1, experts, (133, 2))),
    }
    assert tile_rows(133 * top_k, experts) == 64  # several full tiles and part-filled ones
    for name, ids in routings.items():
        x = rng.normal(0, 1, (len(ids), hidden)).astype(np.float32)
        weights = rng.uniform(0, 1, ids.shape).astype(np.float32)
        got = run(jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(weights), gate_up, down)
        np.testing.assert_allclose(
            np.asarray(got), oracle(x, ids, weights), rtol=1e-5, atol=1e-5, err_msg=name
        )


class MoeLayersOnly(nnx.Module):
    """A test family holding only the checkpoint's MoE layers, so the real loader (by on-disk
    names, through moe_weight_specs) builds a DeepseekMoE from an HF checkpoint."""

    def __init__(self, config: ModelConfig, options=None):
        first = config.hf_config["first_k_dense_replace"]
        self.moe_layers = tuple(range(first, config.num_hidden_layers))
        self.layers = nnx.Dict(
            {str(i): DeepseekMoE(config, config.jnp_dtype) for i in self.moe_layers}
        )

    @classmethod
    def hf_weight_specs(cls, config):
        first = config.hf_config["first_k_dense_replace"]
        return tuple(
            spec
            for i in range(first, config.num_hidden_layers)
            for spec in moe_weight_specs(("layers", str(i)), f"model.layers.{i}.mlp", config)
        )

    @classmethod
    def hf_ignored_weight(cls, name, config):
        first = config.hf_config["first_k_dense_replace"]
        moe = tuple(f"model.layers.{i}.mlp." for i in range(first, config.num_hidden_layers))
        return not name.startswith(moe)

    @classmethod
    def cache_specs(cls, config, options):
        return ()

    def compute_logits(self, hidden):
        raise TypeError("MoeLayersOnly holds only MoE layers and computes no logits")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepseekV3ForCausalLM saved by HF (layer 1 is MoE), with random router weights and
    correction biases large enough to change choices; returns (path, HF model)."""
    import torch
    import transformers

    config = transformers.DeepseekV3Config(**TINY)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "gate.weight" in name else 0.2))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(
                (torch.rand(EXPERTS, generator=gen) - 0.5) * 0.6
            )
    path = tmp_path_factory.mktemp("deepseek_moe") / "ck"
    model.save_pretrained(path, safe_serialization=True)
    with open(path / "config.json") as f:
        cfg = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump({**cfg, "architectures": [ARCH]}, f)
    registry.register(ARCH, MoeLayersOnly, ("generate",))
    yield str(path), model
    registry.unregister(ARCH)


def _load_moe(path, dtype):
    graphdef, state = load_model(path, ModelConfig.from_pretrained(path, dtype=dtype))
    return nnx.merge(graphdef, state).layers["1"]


def _run(moe, x):
    graphdef, state = nnx.split(moe)
    return np.asarray(jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, x))


def test_loads_per_expert_tensors_stacked(checkpoint):
    from safetensors.numpy import load_file

    path, _ = checkpoint
    disk = load_file(f"{path}/model.safetensors")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in disk  # the per-expert hub layout
    moe = _load_moe(path, "float32")
    p = "model.layers.1.mlp."
    for e in (0, 5, 7):
        x = f"{p}experts.{e}."
        gate_up = np.concatenate([disk[x + "gate_proj.weight"].T, disk[x + "up_proj.weight"].T], 1)
        np.testing.assert_array_equal(np.asarray(moe.experts_gate_up[...][e]), gate_up)
        np.testing.assert_array_equal(
            np.asarray(moe.experts_down[...][e]), disk[x + "down_proj.weight"].T
        )
    np.testing.assert_array_equal(np.asarray(moe.router_kernel[...]), disk[p + "gate.weight"].T)
    np.testing.assert_array_equal(
        np.asarray(moe.score_correction_bias[...]), disk[p + "gate.e_score_correction_bias"]
    )
    np.testing.assert_array_equal(
        np.asarray(moe.shared_experts.down_proj.weight[...]),
        disk[p + "shared_experts.down_proj.weight"],
    )
    bf16 = _load_moe(path, "bfloat16")
    assert bf16.experts_gate_up[...].dtype == jnp.bfloat16
    # The router stays float32 (HF keeps it so in any dtype).
    assert bf16.router_kernel[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(bf16.router_kernel[...]), disk[p + "gate.weight"].T)


def test_matches_hf_deepseek_v3_moe_float32(checkpoint):
    import torch

    path, model = checkpoint
    hf_moe = model.model.layers[1].mlp
    moe = _load_moe(path, "float32")
    rng = np.random.default_rng(3)
    for num_tokens in (1, 7, 13, 64):
        x = rng.normal(0, 1, (num_tokens, HIDDEN)).astype(np.float32)
        with torch.no_grad():
            want = hf_moe(torch.from_numpy(x)[None])[0].numpy()
        np.testing.assert_allclose(_run(moe, jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)


def test_matches_hf_deepseek_v3_moe_bfloat16(checkpoint):
    import torch

    path, model = checkpoint
    # HF keeps the router in float32 in a bf16 model (_keep_in_fp32_modules_strict).
    hf_moe = copy.deepcopy(model.model.layers[1].mlp)
    hf_moe.experts.to(torch.bfloat16)
    hf_moe.shared_experts.to(torch.bfloat16)
    moe = _load_moe(path, "bfloat16")
    x = np.random.default_rng(4).normal(0, 1, (29, HIDDEN)).astype(np.float32)
    x_bf16 = torch.from_numpy(x).to(torch.bfloat16)
    with torch.no_grad():
        want = hf_moe(x_bf16[None])[0].float().numpy()
    got = _run(moe, jnp.asarray(x, jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    # bf16 keeps 8 bits of mantissa: a few roundings apart, relative to the output's scale.
    np.testing.assert_allclose(got.astype(np.float32), want, atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize(
    "change, field",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"n_routed_experts": 10, "n_group": 4}, "n_routed_experts"),
        ({"n_group": None}, "n_group"),
        ({"n_group": 8}, "n_group"),  # one expert per group: no top-2 to score a group by
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 5, "topk_group": 2}, "num_experts_per_tok"),
        ({"n_shared_experts": 0}, "n_shared_experts"),
    ],
)
def test_unserved_configs_are_refused_by_field(checkpoint, change, field):
    path, _ = checkpoint
    with open(f"{path}/config.json") as f:
        hf = {**json.load(f), **change}
    config = from_hf_dict(hf, path="ck")
    with pytest.raises(ConfigError, match=f"'{field}' = {change[field]!r}"):
        DeepseekMoE(config, jnp.float32)


def test_a_stacked_spec_needs_equal_runs_per_entry():
    sources = tuple((f"e.{n}.w", (2, 2)) for n in range(5))
    with pytest.raises(ValueError, match="5 sources cannot be stacked 2 ways"):
        WeightSpec(("experts",), sources, stacked=2)
    assert WeightSpec(("experts",), sources, stacked=5).stacked == 5
