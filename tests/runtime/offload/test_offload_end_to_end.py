"""KV offload through the whole engine: a device pool too small to keep earlier prompts, a second
pass that loads their prefixes back from the host store, and a store whose every read fails.

The counts are derived from the workload: 6 distinct prompts of 40 tokens, block_size 4, 4 greedy
tokens each, so a request computes 43 positions and fills 10 whole blocks (the 11th holds the last,
never-computed token). A prefix hit always leaves one prompt token to compute, so a stored prefix
serves at most (40 - 1) // 4 = 9 blocks = 36 tokens of a repeated prompt. The pool (23 usable
blocks, 2 running requests of 11 blocks) keeps at most the last two prompts, and running the
prompts again in order evicts each one before it comes round, so every repeat loads from the store.
"""

import numpy as np
import pytest

from model.testing import write_tiny_checkpoint
from runtime.core.request import SamplingParams
from runtime.offload.device_copy import block_nbytes
from runtime.offload.host_store import HostStore
from runtime.offload.offloader import KVOffloader
from runtime.offload.store import StoreError
from vlax import LLM

NUM_PROMPTS, PROMPT_LEN, BLOCK, MAX_TOKENS = 6, 40, 4, 4
FULL_BLOCKS = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK  # 10 stored per request
HIT_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # 9 loaded per repeated prompt
ENGINE = dict(max_model_len=64, block_size=BLOCK, num_kv_blocks=24, max_num_seqs=2)
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("offload_e2e") / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [
        {"prompt_token_ids": rng.integers(3, 128, PROMPT_LEN).tolist()} for _ in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def baseline(checkpoint, prompts):
    llm = LLM(checkpoint, **ENGINE)
    return tokens(llm, prompts)


class FailingGets(HostStore):
    """A real HostStore (puts land, exists answers truly) whose every read fails, as a store does
    when its memory was reclaimed behind the engine's back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_gets = 0

    def get(self, keys):
        self.num_gets += 1
        raise StoreError(f"injected read failure for {len(keys)} blocks")


def tokens(llm, prompts):
    return [out.outputs[0].token_ids for out in llm.generate(prompts, PARAMS, use_tqdm=False)]


def prefill_since(llm, first_step):
    return sum(s.num_prefill_tokens for s in llm.engine.stats[first_step:])


def test_second_pass_loads_prefixes_from_the_host_store(checkpoint, prompts, baseline):
    llm = LLM(checkpoint, **ENGINE, kv_offload="host", kv_offload_bytes=8 << 20)
    try:
        assert tokens(llm, prompts) == baseline
        assert prefill_since(llm, 0) == NUM_PROMPTS * PROMPT_LEN
        after_first = llm.engine.offload_stats
        assert after_first.blocks_stored == NUM_PROMPTS * FULL_BLOCKS
        assert after_first.blocks_loaded == 0 and after_first.hit_tokens == 0

        first_step = len(llm.engine.stats)
        assert tokens(llm, prompts) == baseline
        stats = llm.engine.offload_stats
        assert stats.blocks_loaded == NUM_PROMPTS * HIT_BLOCKS > 0
        assert stats.hit_tokens == NUM_PROMPTS * HIT_BLOCKS * BLOCK > 0
        # Only the last prompt token of each repeat is computed as prefill.
        assert prefill_since(llm, first_step) == NUM_PROMPTS * (PROMPT_LEN - HIT_BLOCKS * BLOCK)
        # The repeats produced the same blocks, all already stored: nothing is stored twice.
        assert stats.blocks_stored == NUM_PROMPTS * FULL_BLOCKS
        assert stats.load_failures == 0 and stats.store_failures == 0
        assert llm.engine.offloader.errors == []
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.close()


def test_a_store_failing_every_read_falls_back_to_recompute(checkpoint, prompts, baseline):
    llm = LLM(checkpoint, **ENGINE, kv_offload="host", kv_offload_bytes=8 << 20)
    engine = engine_with_store(llm, FailingGets)
    try:
        assert tokens(llm, prompts) == baseline
        first_step = len(engine.stats)
        assert tokens(llm, prompts) == baseline
        stats = engine.offload_stats
        store = engine.offloader.store
        # Every repeat tried one load, which failed; its tokens were computed again instead.
        assert store.num_gets == NUM_PROMPTS
        assert stats.load_failures == NUM_PROMPTS
        assert stats.blocks_loaded == 0 and stats.hit_tokens == 0
        assert prefill_since(llm, first_step) == NUM_PROMPTS * PROMPT_LEN
        # A failed load makes the engine forget those blocks, so the recompute stores them again.
        assert stats.blocks_stored == NUM_PROMPTS * (FULL_BLOCKS + HIT_BLOCKS)
        assert len(engine.offloader.errors) == NUM_PROMPTS
        assert all("injected read failure" in e for e in engine.offloader.errors)
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()


def engine_with_store(llm, store_class):
    """Swap the engine's store for `store_class` (a HostStore) before any request arrives."""
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.stats
    engine.offloader.close()
    store = store_class(8 << 20, block_nbytes(engine.runner.kv_caches))
    engine.offloader = KVOffloader(store)
    return engine
