"""Kimi-Linear (model/kimi_linear.py) against HF transformers on a tiny random checkpoint, float32.

The model is driven directly through model.base.forward with hand-built batches (state slots and
resets as the runner fills them): one prefill batch of prompts of different lengths; a schedule of
chunked prefills (chunk boundaries inside sequences and across the 16-token kernel chunk), decode
steps, a pure-decode step, and a slot reused by a new sequence after its owner finished; greedy
decoding against HF's generate. HF runs its PyTorch reference KDA (no fla here).
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ConfigError, ModelConfig, from_hf_dict
from model.kimi_linear import KimiLinearForCausalLM, kimi_settings
from model.loader import load_model
from model.testing import (
    SeqChunk,
    hf_greedy,
    hf_load,
    hf_logits,
    make_batch,
    scattered_block_tables,
    write_tiny_checkpoint,
)

BLOCK = 16
NUM_SLOTS = 4
SHAPE = dict(num_tokens=64, num_seqs=4, max_blocks=4)  # every batch alike: one compilation


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("kimi"), "kimi_linear", seed=0)
    return ModelConfig.from_pretrained(path, dtype="float32"), hf_load(path)


class Driver:
    """The model under jit with its caches; runs one hand-made step at a time."""

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.graphdef, self.state = load_model(config.path, config, options)
        self.backends = nnx.merge(self.graphdef, self.state).backends
        specs = KimiLinearForCausalLM.cache_specs(config, options)
        self.caches = base.allocate(specs, num_blocks=64, num_slots=NUM_SLOTS)
        self.forward = jax.jit(base.forward, donate_argnums=2)
        self.logits = jax.jit(base.compute_logits)
        self.tables = dict(zip("ABCDEFG", scattered_block_tables([64] * 7, BLOCK), strict=True))

    def step(self, tokens: dict, chunks: list[tuple[str, int, int, int, bool]]) -> dict:
        """chunks: (seq, start, end, slot, reset); returns {seq: logits [end - start, vocab]}."""
        batch = make_batch(
            [SeqChunk(tuple(tokens[s][a:b]), a, self.tables[s]) for s, a, b, _, _ in chunks],
            BLOCK,
            state_slots=[c[3] for c in chunks],
            state_reset=[c[4] for c in chunks],
            scratch_slot=NUM_SLOTS,
            **SHAPE,
        )
        self.caches, hidden = self.forward(self.graphdef, self.state, self.caches, batch)
        rows = np.asarray(self.logits(self.graphdef, self.state, hidden))
        out, start = {}, 0
        for s, a, b, _, _ in chunks:
            out[s] = rows[start : start + b - a]
            start += b - a
        return out


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return {s: [int(t) for t in rng.integers(3, 128, n)] for s, n in lengths.items()}


def _close(ours, theirs, what):
    scale = float(np.abs(theirs).max())
    err = float(np.abs(ours - theirs).max())
    assert err <= 1e-4 * scale, f"{what}: max |diff| {err} against logits up to {scale}"


def test_one_prefill_batch_of_different_lengths(kimi):
    config, hf = kimi
    tokens = _prompts({"A": 5, "B": 17, "C": 40}, seed=1)
    run = Driver(config)
    got = run.step(tokens, [("A", 0, 5, 2, True), ("B", 0, 17, 0, True), ("C", 0, 40, 3, True)])
    for s, toks in tokens.items():
        _close(got[s], hf_logits(hf, toks), s)


def test_chunked_prefill_decode_and_slot_reuse_carry_the_state(kimi):
    config, hf = kimi
    tokens = _prompts({"A": 30, "B": 12, "C": 9, "D": 20}, seed=2)
    want = {s: hf_logits(hf, t) for s, t in tokens.items()}
    run = Driver(config)
    # (seq, start, end, slot, reset): B starts with a one-token chunk (the decode path, fresh);
    # step 3 is decode only; D reuses B's slot 0 after B finished, so it must start from zeros.
    schedule = [
        [("A", 0, 7, 1, True), ("B", 0, 1, 0, True)],
        [("A", 7, 23, 1, False), ("B", 1, 12, 0, False), ("C", 0, 5, 2, True)],
        [("A", 23, 24, 1, False), ("C", 5, 6, 2, False)],
        [("C", 6, 9, 2, False), ("A", 24, 30, 1, False), ("D", 0, 3, 0, True)],
        [("D", 3, 4, 0, False)],
        [("D", 4, 20, 0, False)],
    ]
    seen = {s: np.zeros_like(w) for s, w in want.items()}
    for chunks in schedule:
        for s, rows in run.step(tokens, chunks).items():
            a = next(c[1] for c in chunks if c[0] == s)
            seen[s][a : a + len(rows)] = rows
    for s in tokens:
        _close(seen[s], want[s], s)


def test_greedy_tokens_match_hf_generate(kimi):
    config, hf = kimi
    prompts = _prompts({"A": 11, "B": 4, "C": 26}, seed=3)
    new = 10
    want = {s: hf_greedy(hf, p, new) for s, p in prompts.items()}
    run = Driver(config)
    tokens = {s: list(p) for s, p in prompts.items()}
    slots = {"A": 3, "B": 1, "C": 0}
    chunks = [(s, 0, len(p), slots[s], True) for s, p in prompts.items()]
    for _ in range(new):
        got = run.step(tokens, chunks)
        for s in tokens:
            tokens[s].append(int(np.argmax(got[s][-1])))
        chunks = [(s, len(t) - 1, len(t), slots[s], False) for s, t in tokens.items()]
    assert {s: t[len(prompts[s]) :] for s, t in tokens.items()} == want


def test_pallas_kernels_forced_give_the_reference_logits(kimi):
    """attention_backend="pallas": KDA prefill/decode and the MLA paged attention run the Pallas
    kernels (interpret mode on this CPU host) over a chunked schedule with a decode step."""
    config, _ = kimi
    tokens = _prompts({"A": 21, "B": 6}, seed=4)
    schedule = [
        [("A", 0, 18, 0, True), ("B", 0, 4, 2, True)],
        [("A", 18, 19, 0, False), ("B", 4, 5, 2, False)],
        [("A", 19, 21, 0, False), ("B", 5, 6, 2, False)],
    ]
    reference, pallas = Driver(config), Driver(config, ModelOptions(attention_backend="pallas"))
    assert [(c.op, c.impl, c.interpret) for c in pallas.backends] == [
        ("ragged_paged_attention", "pallas", True),
        ("kda_prefill", "pallas", True),
        ("kda_decode", "pallas", True),
    ]
    for chunks in schedule:
        a, b = reference.step(tokens, chunks), pallas.step(tokens, chunks)
        for s in a:
            np.testing.assert_allclose(b[s], a[s], rtol=1e-4, atol=1e-4 * np.abs(a[s]).max())


def _hub_config(config: ModelConfig) -> dict:
    """The tiny checkpoint's config.json as a hub Kimi-Linear checkpoint spells it."""
    with open(os.path.join(config.path, "config.json")) as f:
        hf = json.load(f)
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim"):
        hf.pop(key, None)
    hf.pop("linear_conv_kernel_dim", None)
    hf["linear_attn_config"] = dict(
        kda_layers=[1, 3], full_attn_layers=[2], num_heads=4, head_dim=16, short_conv_kernel_size=4
    )
    hf["first_k_dense_replace"] = 1
    hf["model_max_length"] = hf.pop("max_position_embeddings", 256)
    renames = {
        "n_routed_experts": "num_experts",
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "n_group": "num_expert_group",
        "norm_topk_prob": "moe_renormalize",
    }
    for old, new in renames.items():
        if old in hf:
            hf[new] = hf.pop(old)
    hf.update(mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1)
    return hf


def test_hub_config_spelling_reads_the_same_and_unserved_fields_are_refused(kimi):
    config, _ = kimi
    hub = from_hf_dict(_hub_config(config), path="hub")
    assert kimi_settings(hub) == kimi_settings(config)
    assert hub.max_position_embeddings == config.max_position_embeddings
    s = kimi_settings(config)
    assert s.layer_types == ("linear_attention", "full_attention", "linear_attention")
    assert s.mlp_types == ("dense", "sparse", "sparse")
    assert (s.moe.n_routed_experts, s.moe.num_experts_per_tok, s.moe.n_shared_experts) == (4, 2, 1)
    bounded = from_hf_dict({**_hub_config(config), "gate_lower_bound": -5.0}, path="hub")
    assert kimi_settings(bounded).kda.gate_lower_bound == -5.0

    def refused(match, **fields):
        cfg = from_hf_dict({**_hub_config(config), **fields}, path="hub")
        with pytest.raises(ConfigError, match=match):
            kimi_settings(cfg)

    refused("'use_full_rank_gate' = True: not served", use_full_rank_gate=True)
    refused("'mla_use_output_gate' = True: not served", mla_use_output_gate=True)
    refused("'mla_use_nope' = False", mla_use_nope=False)
    refused("'moe_layer_freq' = 2", moe_layer_freq=2)
    refused("'gate_lower_bound' = -6.0", gate_lower_bound=-6.0)
    refused("'moe_router_activation_func' = 'softmax'", moe_router_activation_func="softmax")
    linear = dict(_hub_config(config)["linear_attn_config"], use_full_rank_gate=True)
    refused("'linear_attn_config.use_full_rank_gate' = True", linear_attn_config=linear)
    linear = dict(_hub_config(config)["linear_attn_config"], kda_layers=[1])
    refused(r"layers \[3\] are in neither list", linear_attn_config=linear)
    refused("needs at least one full_attention", layer_types=["linear_attention"] * 3)


def test_cache_specs_name_the_latent_pool_and_the_state_slots(kimi):
    config, _ = kimi
    options = ModelOptions(block_size=BLOCK)
    latent, state = KimiLinearForCausalLM.cache_specs(config, options)
    assert (latent.num_layers, latent.page_shape) == (1, (BLOCK, 1, 32))
    assert (state.num_layers, state.parts) == (2, ("recurrent", "conv"))
    assert state.shapes == ((4, 16, 16), (3, 3 * 4 * 16))
    assert state.bytes_per_slot == 2 * (4 * 16 * 16 * 4 + 3 * 192 * 4)
    assert base.bytes_per_block((latent, state)) == BLOCK * 32 * 4
    assert dataclasses.is_dataclass(state) and base.has_state((latent, state))
    assert jnp.dtype(state.dtypes[0]) == jnp.float32
