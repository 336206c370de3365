"""KV offload through the whole engine: a device pool too small to keep earlier prompts, a second
pass that loads their prefixes back from the host store, and a store whose every read fails.

The counts are derived from the workload: 6 distinct prompts of 40 tokens, block_size 4, 4 greedy
tokens each, so a request computes 43 positions and fills 10 whole blocks (the 11th holds the last,
never-computed token). A prefix hit always leaves one prompt token to compute, so a stored prefix
serves at most (40 - 1) // 4 = 9 blocks = 36 tokens of a repeated prompt. The pool (23 usable
blocks, 2 running requests of 11 blocks) keeps at most the last two prompts, and running the
prompts again in order evicts each one before it comes round, so every repeat loads from the store.
Stores other than "host" are passed as objects (`kv_offload=<store>`), never swapped in.
"""

import threading

import numpy as np
import pytest

from model.testing import write_tiny_checkpoint
from runtime.config import ConfigError
from runtime.core.request import SamplingParams
from runtime.offload.device_copy import block_nbytes
from runtime.offload.fault_injection import FaultyStore
from runtime.offload.host_store import HostStore
from runtime.offload.store import PutResult, StoreError
from vlax import LLM

NUM_PROMPTS, PROMPT_LEN, BLOCK, MAX_TOKENS = 6, 40, 4, 4
FULL_BLOCKS = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK  # 10 stored per request
HIT_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # 9 loaded per repeated prompt
# record_steps=None: the checks read every step's stats and scheduler output.
ENGINE = dict(
    max_model_len=64, block_size=BLOCK, num_kv_blocks=24, max_num_seqs=2, record_steps=None
)
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
def plain(checkpoint):
    """An engine without offload: the reference tokens, and the KV block size a store needs."""
    return LLM(checkpoint, **ENGINE)


@pytest.fixture(scope="module")
def baseline(plain, prompts):
    return tokens(plain, prompts)


@pytest.fixture(scope="module")
def nbytes(plain):
    return block_nbytes(plain.engine.runner.kv_caches)


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


def test_a_store_failing_every_read_falls_back_to_recompute(checkpoint, prompts, baseline, nbytes):
    store = FailingGets(8 << 20, nbytes)
    llm = LLM(checkpoint, **ENGINE, kv_offload=store)
    engine = llm.engine
    try:
        assert tokens(llm, prompts) == baseline
        first_step = len(engine.stats)
        assert tokens(llm, prompts) == baseline
        stats = engine.offload_stats
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
    # The store was ours: the engine left it open, still holding what the engine stored.
    assert store.exists(store_keys(llm, prompts[:1]))[0]
    store.close()


def test_a_wrapped_store_serves_the_engine_and_stays_open(checkpoint, prompts, baseline, nbytes):
    """Any object with the KVStore members works: here a FaultyStore that injects nothing, around
    a HostStore. The engine uses it as its own (loads on the second pass) but does not close it."""
    host = HostStore(8 << 20, nbytes)
    store = FaultyStore(host, read_fault_rate=0.0, write_fault_rate=0.0)
    llm = LLM(checkpoint, **ENGINE, kv_offload=store)
    try:
        assert tokens(llm, prompts) == baseline
        assert tokens(llm, prompts) == baseline
        stats = llm.engine.offload_stats
        assert stats.blocks_loaded == NUM_PROMPTS * HIT_BLOCKS
        assert stats.blocks_stored == NUM_PROMPTS * FULL_BLOCKS
        assert store.calls["put"] > 0 and store.calls["get"] == NUM_PROMPTS
        assert store.num_injected == 0
    finally:
        llm.engine.close()
    assert len(host) == NUM_PROMPTS * FULL_BLOCKS
    store.close()
    with pytest.raises(StoreError, match="closed"):
        host.get(store_keys(llm, prompts[:1]))


class BlockCache:
    """A dict of blocks that implements the KVStore members and nothing else (no base class)."""

    shared = False

    def __init__(self, block_nbytes):
        self.block_nbytes = block_nbytes
        self.blocks = {}

    def exists(self, keys):
        return tuple(k in self.blocks for k in keys)

    def put(self, keys, values):
        self.blocks.update((k, bytes(v)) for k, v in zip(keys, values, strict=True))
        return PutResult(stored=(True,) * len(keys))

    def get(self, keys):
        return tuple(self.blocks.get(k) for k in keys)

    def remove(self, keys):
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def close(self):
        self.blocks.clear()


def test_any_object_with_the_store_members_is_a_store(checkpoint, prompts, baseline, nbytes):
    store = BlockCache(nbytes)
    llm = LLM(checkpoint, **ENGINE, kv_offload=store)
    try:
        assert tokens(llm, prompts) == baseline
        assert tokens(llm, prompts) == baseline
        assert llm.engine.offload_stats.blocks_loaded == NUM_PROMPTS * HIT_BLOCKS
        assert len(store.blocks) == NUM_PROMPTS * FULL_BLOCKS
    finally:
        llm.engine.close()


class NoGets:
    block_nbytes = 64

    def exists(self, keys):
        return ()

    def put(self, keys, values):
        return PutResult(stored=())


def test_an_object_that_is_not_a_store_is_refused_by_name(checkpoint, nbytes):
    with pytest.raises(ConfigError) as info:
        LLM(checkpoint, **ENGINE, kv_offload=NoGets())
    message = str(info.value)
    assert "kv_offload=NoGets object does not implement the KV store protocol" in message
    assert "no method get(); no method remove(); no method close()" in message
    assert "shared=None is not a bool" in message
    assert "no method put" not in message and "block_nbytes" in message
    with pytest.raises(ConfigError, match="kv_offload must be one of .* or a KV store object"):
        LLM(checkpoint, **ENGINE, kv_offload="disk")
    wrong = BlockCache(nbytes // 2)
    with pytest.raises(ConfigError) as info:
        LLM(checkpoint, **ENGINE, kv_offload=wrong)
    assert f"holds blocks of {nbytes // 2} bytes" in str(info.value)
    assert f"create the store with block_nbytes={nbytes}" in str(info.value)


def store_keys(llm, prompts):
    """The block hashes of the prompts' first full blocks, as the engine keys them."""
    from runtime.core.kv.kv_cache import extend_block_hashes

    block_size = llm.engine.config.block_size
    return [extend_block_hashes((), p["prompt_token_ids"], block_size)[0] for p in prompts]


class PoolWithMasterDown(HostStore):
    """A real HostStore shared like a pool (so the engine asks it about each new request's
    prefix) whose `exists` blocks until `up` is set: a Mooncake pool whose master is down blocks
    each call for ~4 s. The wait is a hang guard, never a timing the test relies on."""

    shared = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.up = threading.Event()
        self.up.set()
        self.lookups = 0

    def exists(self, keys):
        self.lookups += 1
        if not self.up.wait(timeout=600):
            raise StoreError("the master never came back")
        return super().exists(keys)


def test_a_shared_store_that_blocks_does_not_stall_the_engine(
    checkpoint, prompts, baseline, nbytes
):
    """Lookups in a shared store used to run in add_request, on the engine thread: with the pool's
    master down, every new request stalled the whole batch. Now a new request waits for its answer
    outside the scheduler while the others run; aborting it then gives its one final output, and
    its late answer does not admit a later request that reuses its id."""
    store = PoolWithMasterDown(8 << 20, nbytes)
    llm = LLM(checkpoint, **ENGINE, kv_offload=store)
    engine = llm.engine
    ids = lambda i: prompts[i]["prompt_token_ids"]  # noqa: E731
    finals = {}

    def step():
        for out in engine.step():
            assert out.request_id not in finals, f"second final output for {out.request_id}"
            finals[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].token_ids)

    try:
        engine.add_request("a", ids(0), PARAMS)
        while "a" not in engine.state.requests or not engine.state.requests["a"].output_token_ids:
            step()
        store.up.clear()  # the master goes down
        engine.add_request("b", ids(1), PARAMS)  # returns: the lookup waits on its own thread
        engine.add_request("c", ids(2), PARAMS)
        (aborted,) = engine.abort_request(["c"])
        assert aborted.request_id == "c" and aborted.outputs[0].finish_reason == "abort"
        engine.add_request("c", ids(3), PARAMS)  # the id again, a new request
        while "a" not in finals:  # "a" runs to its end while the others wait for the pool
            step()
            assert not {"b", "c"} & set(engine.state.requests)
        assert finals["a"] == ("length", baseline[0])
        store.up.set()  # the master is back
        while engine.has_unfinished_requests():
            step()
        assert finals == {
            "a": ("length", baseline[0]),
            "b": ("length", baseline[1]),
            "c": ("length", baseline[3]),
        }
        assert store.lookups == 4 and engine.offloader.errors == []
    finally:
        engine.close()
        store.close()
