"""`forward(..., rows)`: the final hidden state of the sampled rows alone, the last layer's MLP run
on them only, equal to every row's state gathered, with the same caches written, for every
generative family (Llama, Qwen3, DeepSeek-V3 MLA/MoE, Kimi-Linear KDA + MLA, PaliGemma's Gemma)."""

import jax
import numpy as np
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ModelConfig
from model.loader import load_model
from model.testing import SeqChunk, make_batch, scattered_block_tables, write_tiny_checkpoint
from model.testing_multimodal import write_tiny_paligemma

BLOCK = 16
NUM_SLOTS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {
        arch: write_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=3)
        for arch in ("llama", "qwen3", "deepseek_v3", "kimi_linear")
    }
    paths["paligemma"] = write_tiny_paligemma(tmp_path_factory.mktemp("paligemma"), seed=3)
    return paths


def test_rows_equal_every_rows_state_gathered(checkpoints):
    rng = np.random.default_rng(0)
    lengths = (5, 19, 3)
    tables = scattered_block_tables([64] * len(lengths), BLOCK)
    for arch, path in checkpoints.items():
        config = ModelConfig.from_pretrained(path, dtype="float32")
        options = ModelOptions(block_size=BLOCK)
        graphdef, state = load_model(path, config, options)
        family = type(nnx.merge(graphdef, state))
        assert base._takes_rows(family), arch  # its own last layer prunes, not a gather after
        specs = family.cache_specs(config, options)
        chunks = [
            SeqChunk(tuple(int(t) for t in rng.integers(3, 100, n)), 0, table)
            for n, table in zip(lengths, tables, strict=True)
        ]
        slots = dict(state_slots=[0, 1, 2], state_reset=[True] * 3, scratch_slot=NUM_SLOTS)
        batch = make_batch(chunks, BLOCK, num_tokens=32, num_seqs=4, max_blocks=4, **slots)
        caches = [base.allocate(specs, num_blocks=64, num_slots=NUM_SLOTS) for _ in "ab"]
        whole_caches, hidden = jax.jit(base.forward)(graphdef, state, caches[0], batch)
        rows_caches, rows = jax.jit(base.forward)(
            graphdef, state, caches[1], batch, batch.logits_indices
        )
        want = np.asarray(hidden)[np.asarray(batch.logits_indices)]
        assert rows.shape == want.shape, arch
        np.testing.assert_allclose(np.asarray(rows), want, rtol=1e-5, atol=1e-5, err_msg=arch)
        for got, expected in zip(
            jax.tree_util.tree_leaves(rows_caches),
            jax.tree_util.tree_leaves(whole_caches),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=arch)
