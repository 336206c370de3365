"""KV offload, budget and preemption with a cache of several pools whose pages differ in shape (the
DeepSeek-V3.2 situation: an MLA latent [bs, 1, 576], indexer keys [bs, 1, 128], beside K/V pools).

A stored block is its slice of every array of every pool; loading it back writes every pool. The
end-to-end check runs a test-only family, registered through model.registry, that keeps a Llama's
cache in three pools of different page shapes and uses all of them: layers 0-1 keep K/V as usual
[bs, Hkv, D]; layer 2 keeps its keys as one shared head [bs, 1, Hkv*D] and its values as a flat
page [bs, Hkv*D], reshaped for attention. So its tokens equal HF Llama's, and a pool that is not
stored or not loaded changes them.

Workload as in test_offload_end_to_end.py: 6 distinct prompts of 40 tokens, block_size 4, 4 greedy
tokens, so a request fills 10 whole blocks and a repeat can load (40 - 1) // 4 = 9 of them.
"""

import json
import os

import jax
import numpy as np
import pytest

from model import base, registry
from model.base import ModelOptions, PagedCacheSpec, paged_kv_spec
from model.layers.rotary import rotary_cos_sin
from model.llama import LlamaForCausalLM
from model.testing import hf_greedy, hf_load, write_tiny_checkpoint
from runtime.core.request import SamplingParams
from runtime.offload.device_copy import block_nbytes, gather_blocks, rows_to_host, scatter_blocks
from runtime.offload.testing import check_store_then_load
from vlax import LLM

NUM_PROMPTS, PROMPT_LEN, BLOCK, MAX_TOKENS = 6, 40, 4, 4
FULL_BLOCKS = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK  # 10 stored per request
HIT_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # 9 loaded per repeated prompt
LAYERS, KV_LAYERS, HKV, HEAD_DIM = 3, 2, 2, 16
# Per block (f32): 2 layers x (k, v) x [4, 2, 16], then [4, 1, 32] and [4, 32] for layer 2.
POOL_BYTES = (KV_LAYERS * 2 * BLOCK * HKV * HEAD_DIM * 4, BLOCK * 32 * 4, BLOCK * 32 * 4)
BLOCK_BYTES = sum(POOL_BYTES)  # 3072
NUM_BLOCKS = 24  # 23 usable: two running requests of 11 blocks fit, a third prompt's do not
ENGINE = dict(max_model_len=64, block_size=BLOCK, max_num_seqs=2, record_steps=None)
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCH = "SplitPoolsLlamaForCausalLM"


class SplitPoolsLlama(LlamaForCausalLM):
    """Llama whose last layers keep keys and values in pools of their own page shapes."""

    def __init__(self, config, options: ModelOptions = ModelOptions()):  # noqa: B008
        super().__init__(config, options)
        self.specs = self.cache_specs(config, options)

    @classmethod
    def cache_specs(cls, config, options):
        bs, dtype = options.block_size, options.resolve_cache_dtype(config)
        hkv, d = config.num_key_value_heads, config.head_dim
        rest = config.num_hidden_layers - KV_LAYERS
        return (
            paged_kv_spec(KV_LAYERS, bs, hkv, d, dtype),
            PagedCacheSpec("keys, one shared head", rest, ("k",), (bs, 1, hkv * d), dtype),
            PagedCacheSpec("values, flat", rest, ("v",), (bs, hkv * d), dtype),
        )

    def __call__(self, caches, batch):
        kv, keys, values = base.split_caches(self.specs, caches)
        x = self.model.embed_tokens(batch.token_ids)
        cos, sin = rotary_cos_sin(batch.positions, self.model.rope, x.dtype)
        layers = list(self.model.layers)
        new_kv = []
        for layer, entry in zip(layers[:KV_LAYERS], kv, strict=True):
            x, entry = layer(x, cos, sin, entry, batch)
            new_kv.append(entry)
        shape = new_kv[0][0].shape  # [num_blocks, block_size, Hkv, D]
        new_keys, new_values = [], []
        for layer, (k,), (v,) in zip(layers[KV_LAYERS:], keys, values, strict=True):
            x, (k4, v4) = layer(x, cos, sin, (k.reshape(shape), v.reshape(shape)), batch)
            new_keys.append((k4.reshape(k.shape),))
            new_values.append((v4.reshape(v.shape),))
        return (*new_kv, *new_keys, *new_values), self.model.norm(x)


def test_gather_and_scatter_move_a_block_of_every_pool():
    """Pools of three page shapes and two dtypes: a block's row holds its slice of every array,
    and scattering the row into other block ids writes that slice into every array."""
    specs = (
        paged_kv_spec(2, BLOCK, 2, 8, "bfloat16"),
        PagedCacheSpec("MLA latent", 2, ("latent",), (BLOCK, 1, 24), "float32"),
        PagedCacheSpec("indexer keys", 1, ("keys",), (BLOCK, 1, 8), "bfloat16"),
    )
    num_blocks = 8

    def filled(seed):
        leaves, tree = jax.tree_util.tree_flatten(base.allocate(specs, num_blocks))
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        return jax.tree_util.tree_unflatten(
            tree,
            [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)],
        )

    def block_bytes(caches, blocks):
        leaves = jax.tree_util.tree_leaves(caches)
        return [b"".join(np.asarray(a[b]).tobytes() for a in leaves) for b in blocks]

    source = filled(0)
    assert block_nbytes(source) == base.bytes_per_block(specs)
    rows = rows_to_host(*gather_blocks(source, [5, 2, 7]))
    assert [r.tobytes() for r in rows] == block_bytes(source, [5, 2, 7])
    target, finite = scatter_blocks(filled(1), [1, 3, 4], rows)
    assert finite
    untouched = [0, 2, 5, 6, 7]
    arrays = zip(*map(jax.tree_util.tree_leaves, (source, filled(1), target)), strict=True)
    for src, before, after in map(lambda t: map(np.asarray, t), arrays):
        np.testing.assert_array_equal(after[[1, 3, 4]], src[[5, 2, 7]])
        np.testing.assert_array_equal(after[untouched], before[untouched])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("many_pools") / "ck", "llama", seed=4, num_hidden_layers=LAYERS
    )
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = [ARCH]
    with open(config_file, "w") as f:
        json.dump(config, f)
    registry.register(ARCH, SplitPoolsLlama, ("generate",))
    yield path
    registry.unregister(ARCH)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [
        {"prompt_token_ids": rng.integers(3, 128, PROMPT_LEN).tolist()} for _ in range(NUM_PROMPTS)
    ]


def tokens(llm, prompts):
    return [out.outputs[0].token_ids for out in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(checkpoint, logger_messages):
    """An engine without offload, sized by a byte budget."""
    with logger_messages("runtime.runner.model_runner") as log:
        llm = LLM(
            checkpoint,
            dtype="float32",
            **ENGINE,
            kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES + BLOCK_BYTES - 1,
        )
    runner = llm.engine.runner
    assert [s.bytes_per_block for s in runner.cache_specs] == list(POOL_BYTES)
    assert runner.num_kv_blocks == NUM_BLOCKS  # the budget over the sum of every pool's bytes
    (line,) = [m for m in log.records if m.startswith("KV cache:")]
    for spec, nbytes in zip(runner.cache_specs, POOL_BYTES, strict=True):
        assert f"{spec.name} {NUM_BLOCKS * nbytes} bytes" in line
    return llm


@pytest.fixture(scope="module")
def baseline(checkpoint, plain, prompts):
    """Tokens without offload; they are HF Llama's."""
    out = tokens(plain, prompts)
    hf = hf_load(checkpoint)
    assert out[:2] == [hf_greedy(hf, p["prompt_token_ids"], MAX_TOKENS) for p in prompts[:2]]
    return out


def test_every_pool_of_a_block_is_stored_and_loaded(checkpoint, prompts, baseline):
    llm = LLM(
        checkpoint,
        dtype="float32",
        **ENGINE,
        num_kv_blocks=NUM_BLOCKS,
        kv_offload="host",
        kv_offload_bytes=1 << 20,
    )
    try:
        assert llm.engine.offloader.store.block_nbytes == BLOCK_BYTES
        check_store_then_load(
            llm,
            lambda engine: tokens(engine, prompts),
            baseline,
            stored=NUM_PROMPTS * FULL_BLOCKS,
            loaded=NUM_PROMPTS * HIT_BLOCKS,
            prefilled=NUM_PROMPTS * (PROMPT_LEN - HIT_BLOCKS * BLOCK),
        )
    finally:
        llm.engine.close()


def test_preemption_with_offload_refills_every_pool(checkpoint, prompts):
    """Two requests of 20-token prompts that grow to 60 tokens (15 blocks each) in 16 usable
    blocks: one is preempted, and its tokens are recomputed or loaded back into every pool."""
    short = [{"prompt_token_ids": p["prompt_token_ids"][:20]} for p in prompts[:4]]
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hf = hf_load(checkpoint)
    want = [hf_greedy(hf, p["prompt_token_ids"], 40) for p in short]
    llm = LLM(
        checkpoint,
        dtype="float32",
        **ENGINE,
        num_kv_blocks=17,
        kv_offload="host",
        kv_offload_bytes=1 << 20,
    )
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(short, long_params, use_tqdm=False)]
        assert got == want
        assert llm.engine.totals.preemptions > 0
        assert llm.engine.offload_stats.blocks_stored > 0
        assert llm.engine.offloader.errors == []
    finally:
        llm.engine.close()
