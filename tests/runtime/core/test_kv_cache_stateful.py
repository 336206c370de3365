"""Random allocate / step / hit / free / re-admit / pin / unpin / misuse sequences on a KV cache.

After every step: the state's invariants hold, the free order equals a simple model of vLLM's
free queue (freed blocks holding no hash go to the front, hashed ones to the back), block hashes
equal a model of what was cached and evicted, and a few older states still show exactly what they
showed when they were made.
"""

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kv

NUM_BLOCKS, BS, MAX_LEN = 24, 4, 40
PREFIXES = (tuple(range(100, 120)), tuple(range(200, 220)))
EXTRAS = (kv.HashExtras(), kv.HashExtras(cache_salt="s"), kv.HashExtras(lora_name="l"))


@dataclass(frozen=True)
class Req:
    block_hashes: tuple[bytes, ...]
    num_tokens: int


def snapshot(state: kv.KVCache) -> tuple:
    pool = state.pool
    blocks = range(1, pool.num_blocks)
    return (
        bp.free_order(pool),
        tuple(bp.ref_count(pool, b) for b in blocks),
        tuple(bp.block_hash_of(pool, b) for b in blocks),
        dict(state.tables),
        dict(state.num_cached),
    )


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = kv.make_kv_cache(NUM_BLOCKS, BS, max_model_len=MAX_LEN)
        self.free_model = list(range(1, NUM_BLOCKS))  # expected eviction order
        self.refs = Counter()
        self.hash_model: dict[int, bytes] = {}
        self.pins: list[int] = []
        self.live: dict[str, dict] = {}  # rid -> tokens, extras, computed
        self.parked: list[dict] = []  # freed requests that may be re-admitted
        self.old: list[tuple] = []
        self.next_id = 0

    # ------------------------------------------------------------ model helpers

    def _take(self, new_blocks) -> None:
        assert tuple(self.free_model[: len(new_blocks)]) == new_blocks
        del self.free_model[: len(new_blocks)]
        for block in new_blocks:
            self.refs[block] += 1
            self.hash_model.pop(block, None)

    def _touch(self, blocks) -> None:
        for block in blocks:
            if self.refs[block] == 0:
                self.free_model.remove(block)
            self.refs[block] += 1

    def _release(self, blocks) -> None:
        # vLLM's free_blocks: freed blocks holding no hash go to the front as a group, those
        # holding one to the back, each in the order given.
        front, back = [], []
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                (back if block in self.hash_model else front).append(block)
        self.free_model[:0] = front
        self.free_model.extend(back)

    def _allocate(self, rid, entry, num_new, cached=(), lookahead=0) -> bool:
        tokens, computed = entry["tokens"], entry["computed"]
        hashes = kv.extend_block_hashes((), tokens, BS, entry["extras"])
        table_before = self.state.tables.get(rid, ())
        out = kv.allocate_slots(
            self.state, rid, num_new, computed, cached, lookahead, block_hashes=hashes
        )
        if isinstance(out, kv.CannotAllocate):
            assert out.blocks_free == kv.num_free_blocks(self.state)
            assert out.blocks_needed > out.blocks_free
            return False
        self._touch(cached)
        self._take(out.new_block_ids)
        filled = computed + len(cached) * BS + num_new
        table = kv.blocks_of(out.state, rid)
        assert table == (tuple(cached) or table_before) + out.new_block_ids
        assert len(table) == max(len(table_before), -(-min(filled + lookahead, MAX_LEN) // BS))
        num_cached = min(filled // BS, len(hashes))
        assert out.state.num_cached[rid] == num_cached
        for position in range(num_cached):
            self.hash_model[table[position]] = hashes[position]
        self.state = out.state
        entry["computed"] = filled
        return True

    def _keep_old(self) -> None:
        self.old.append((self.state, snapshot(self.state), list(self.pins)))
        if len(self.old) > 4:
            self.old.pop(0)

    # ------------------------------------------------------------ rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        shared=st.integers(0, 20),
        own=st.integers(0, 9),
        extras=st.sampled_from(EXTRAS),
        chunk=st.integers(1, 40),
        lookahead=st.integers(0, 3),
    )
    def admit(self, prefix, shared, own, extras, chunk, lookahead):
        tokens = list(prefix[:shared]) + [1000 + self.next_id * 16 + i for i in range(own)]
        if not tokens:
            return
        self._keep_old()
        rid = f"r{self.next_id}"
        self.next_id += 1
        self._admit(rid, {"tokens": tokens, "extras": extras, "computed": 0}, chunk, lookahead)

    def _admit(self, rid, entry, chunk, lookahead):
        hashes = kv.extend_block_hashes((), entry["tokens"], BS, entry["extras"])
        hit = kv.find_cached_prefix(self.state, Req(hashes, len(entry["tokens"])))
        assert hit.num_tokens <= len(entry["tokens"]) - 1
        for position, block in enumerate(hit.blocks):
            assert bp.block_hash_of(self.state.pool, block) == hashes[position]
        limit = (len(entry["tokens"]) - 1) // BS
        if len(hit.blocks) < min(limit, len(hashes)):  # the hit stops at a real miss
            assert bp.lookup_cached(self.state.pool, hashes[len(hit.blocks)]) is None
        num_new = min(chunk, len(entry["tokens"]) - hit.num_tokens)
        if self._allocate(rid, entry, num_new, hit.blocks, lookahead):
            self.live[rid] = entry
        else:
            self.parked.append(entry)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), decode=st.integers(1, 3))
    def step(self, data, chunk, decode):
        """Continue a prefill chunk, or append decoded tokens and compute them."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        entry = self.live[rid]
        if entry["computed"] == len(entry["tokens"]):
            if len(entry["tokens"]) + decode > MAX_LEN:
                return
            entry["tokens"] = entry["tokens"] + [7] * decode
        self._keep_old()
        self._allocate(rid, entry, min(chunk, len(entry["tokens"]) - entry["computed"]))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._keep_old()
        table = kv.blocks_of(self.state, rid)
        self.state = kv.free(self.state, rid)
        self._release(reversed(table))
        entry = self.live.pop(rid)
        self.parked.append({**entry, "computed": 0})

    @precondition(lambda self: self.parked)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def readmit(self, data, chunk):
        entry = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        self._keep_old()
        rid = f"r{self.next_id}"
        self.next_id += 1
        self._admit(rid, entry, chunk, 0)

    @precondition(lambda self: self.state.pool.next_fresh > 1)
    @rule(data=st.data())
    def pin(self, data):
        handed_out = st.integers(1, self.state.pool.next_fresh - 1)
        blocks = data.draw(st.lists(handed_out, min_size=1, max_size=3))
        self._keep_old()
        self.state = kv.pin(self.state, blocks)
        self._touch(blocks)
        self.pins.extend(blocks)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        count = data.draw(st.integers(1, len(self.pins)))
        blocks = self.pins[-count:][::-1]
        self._keep_old()
        self.state = kv.unpin(self.state, blocks)
        self._release(blocks)
        del self.pins[-count:]

    @rule(kind=st.integers(0, 4), data=st.data())
    def misuse(self, kind, data):
        free_block = next((b for b in self.free_model if b < self.state.pool.next_fresh), None)
        held = [b for b, n in self.refs.items() if n]
        actions = {
            0: lambda: kv.free(self.state, "never-admitted"),
            1: lambda: kv.allocate_slots(self.state, "big", MAX_LEN + 1, 0),
            2: lambda: kv.pin(self.state, held[:1] + [NUM_BLOCKS]),
            3: lambda: kv.unpin(self.state, held[:2] + [free_block or 0]),
            4: lambda: kv.allocate_slots(self.state, "neg", -1, 0),
        }
        before = snapshot(self.state)
        with pytest.raises(ValueError):
            actions[kind]()
        assert snapshot(self.state) == before

    # ------------------------------------------------------------ invariants

    @invariant()
    def state_matches_the_model(self):
        kv.check_invariants(self.state, extra_holders=self.pins)
        assert bp.free_order(self.state.pool) == tuple(self.free_model)
        pool = self.state.pool
        for block in range(1, NUM_BLOCKS):
            assert bp.block_hash_of(pool, block) == self.hash_model.get(block), block

    @invariant()
    def old_states_are_unchanged(self):
        for state, shot, pins in self.old:
            assert snapshot(state) == shot
            kv.check_invariants(state, extra_holders=pins)


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50)
test_kv_cache_state_machine = KVCacheMachine.TestCase
