"""KV cache rules: the N-1 prefix hit, allocate_slots layout and caching, free order, pins, misuse."""

from dataclasses import dataclass, replace

import pytest

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kv
from runtime.core.kv.kv_invariants import InvariantError

BS = 4


@dataclass(frozen=True)
class Req:
    block_hashes: tuple[bytes, ...]
    num_tokens: int


def req(tokens) -> Req:
    return Req(kv.extend_block_hashes((), tokens, BS), len(tokens))


def admit(state, rid, tokens, lookahead=0):
    r = req(tokens)
    hit = kv.find_cached_prefix(state, r)
    out = kv.allocate_slots(
        state,
        rid,
        r.num_tokens - hit.num_tokens,
        0,
        hit.blocks,
        lookahead,
        block_hashes=r.block_hashes,
    )
    assert isinstance(out, kv.Allocated), out
    kv.check_invariants(out.state)
    return out, hit


def snapshot(state) -> tuple:
    pool = state.pool
    blocks = range(1, pool.num_blocks)
    return (
        bp.free_order(pool),
        tuple(bp.ref_count(pool, b) for b in blocks),
        tuple(bp.block_hash_of(pool, b) for b in blocks),
        dict(state.tables),
        dict(state.num_cached),
    )


def test_prefix_hit_is_whole_blocks_and_leaves_one_token_to_compute():
    state = kv.make_kv_cache(32, BS, max_model_len=64)
    prompt = list(range(12))  # exactly three blocks
    out, _ = admit(state, "a", prompt)
    assert out.new_block_ids == (1, 2, 3) and kv.blocks_of(out.state, "a") == (1, 2, 3)
    assert out.state.num_cached["a"] == 3
    # Fully cached, block-aligned: the last block is recomputed (N-1 rule).
    assert kv.find_cached_prefix(out.state, req(prompt)) == kv.CachedPrefix((1, 2), 8)
    assert kv.find_cached_prefix(out.state, req(prompt + [99])) == kv.CachedPrefix((1, 2, 3), 12)
    assert kv.find_cached_prefix(out.state, req(prompt[:5])) == kv.CachedPrefix((1,), 4)
    assert kv.find_cached_prefix(out.state, req([7] + prompt[1:])).num_tokens == 0
    assert kv.find_cached_prefix(out.state, Req((), 0)) == kv.CachedPrefix((), 0)


def test_prefix_hit_shares_blocks_and_new_blocks_follow_the_cached_head():
    state = kv.make_kv_cache(32, BS, max_model_len=64)
    out, _ = admit(state, "a", list(range(10)))
    out, hit = admit(out.state, "b", list(range(8)) + [50, 51, 52])
    assert hit.blocks == (1, 2)
    assert kv.blocks_of(out.state, "b") == (1, 2, 4) and out.new_block_ids == (4,)
    assert bp.ref_count(out.state.pool, 1) == 2 and bp.ref_count(out.state.pool, 3) == 1


def test_lookahead_and_decode_allocate_only_missing_blocks():
    state = kv.make_kv_cache(32, BS, max_model_len=20)
    out = kv.allocate_slots(state, "a", 5, 0, lookahead=3)
    assert out.new_block_ids == (1, 2)
    out = kv.allocate_slots(out.state, "a", 3, 5)
    assert out.new_block_ids == ()
    out = kv.allocate_slots(out.state, "a", 1, 8)
    assert out.new_block_ids == (3,)
    # Lookahead is capped at max_model_len, not rejected.
    out = kv.allocate_slots(out.state, "a", 11, 9, lookahead=4)
    assert len(kv.blocks_of(out.state, "a")) == 5
    kv.check_invariants(out.state)


def test_newly_full_blocks_are_cached_as_prefill_proceeds_in_chunks():
    state = kv.make_kv_cache(32, BS, max_model_len=64)
    prompt = list(range(14))
    hashes = req(prompt).block_hashes
    out = kv.allocate_slots(state, "a", 6, 0, block_hashes=hashes)
    assert out.state.num_cached["a"] == 1 and bp.lookup_cached(out.state.pool, hashes[0]) == 1
    assert bp.lookup_cached(out.state.pool, hashes[1]) is None
    out = kv.allocate_slots(out.state, "a", 8, 6, block_hashes=hashes)
    assert out.state.num_cached["a"] == 3
    assert [bp.lookup_cached(out.state.pool, x) for x in hashes] == [1, 2, 3]
    kv.check_invariants(out.state)


def test_without_prefix_caching_nothing_is_cached_or_hit():
    state = kv.make_kv_cache(32, BS, max_model_len=64, enable_prefix_caching=False)
    r = req(list(range(12)))
    out = kv.allocate_slots(state, "a", 12, 0, block_hashes=r.block_hashes)
    assert bp.num_cached_blocks(out.state.pool) == 0 and out.state.num_cached["a"] == 0
    assert kv.find_cached_prefix(out.state, r) == kv.CachedPrefix((), 0)
    with pytest.raises(kv.KVCacheError, match="prefix caching is off"):
        kv.allocate_slots(out.state, "b", 4, 0, (1,))


def test_cannot_allocate_counts_revived_cached_blocks_and_changes_nothing():
    state = kv.make_kv_cache(7, BS, max_model_len=64)
    out, _ = admit(state, "a", list(range(9)))  # blocks 1, 2, 3
    state = kv.free(out.state, "a")
    out, _ = admit(state, "x", [90, 91, 92])  # takes block 4
    before = snapshot(out.state)
    r = req(list(range(9)) + list(range(20, 35)))  # 6 blocks: 2 cached (free) + 4 new
    hit = kv.find_cached_prefix(out.state, r)
    assert hit.blocks == (1, 2)
    refused = kv.allocate_slots(
        out.state, "b", r.num_tokens - hit.num_tokens, 0, hit.blocks, block_hashes=r.block_hashes
    )
    assert refused == kv.CannotAllocate(blocks_needed=6, blocks_free=5)
    assert snapshot(out.state) == before


def test_free_releases_tail_first_so_the_shared_prefix_is_evicted_last():
    state = kv.make_kv_cache(6, BS, max_model_len=64)
    out, _ = admit(state, "a", list(range(12)))
    state = kv.free(out.state, "a")
    assert bp.free_order(state.pool) == (4, 5, 3, 2, 1)
    assert not kv.has_request(state, "a")
    out = kv.allocate_slots(state, "b", 12, 0)  # evicts the tail of "a" first
    assert out.new_block_ids == (4, 5, 3)
    assert kv.find_cached_prefix(out.state, req(list(range(12)))).blocks == (1, 2)


def test_pins_keep_blocks_out_of_the_free_list_after_the_request_frees():
    state = kv.make_kv_cache(8, BS, max_model_len=64)
    out, _ = admit(state, "a", list(range(8)))
    table = kv.blocks_of(out.state, "a")
    pinned = kv.pin(out.state, table)
    assert [bp.ref_count(pinned.pool, b) for b in table] == [2, 2]
    freed = kv.free(pinned, "a")
    assert [bp.ref_count(freed.pool, b) for b in table] == [1, 1]
    kv.check_invariants(freed, extra_holders=table)
    assert kv.num_free_blocks(freed) == 5
    done = kv.unpin(freed, tuple(reversed(table)))
    assert bp.free_order(done.pool)[-2:] == (2, 1)
    kv.check_invariants(done)
    with pytest.raises(InvariantError, match="ref count 1 but 0 holders"):
        kv.check_invariants(freed)  # the pins are not declared


def test_invariants_catch_a_free_queue_out_of_vllms_order():
    """Freed unhashed blocks, then never-used ones, then freed hashed ones; `split` marks the
    first group's end while never-used blocks remain."""
    state = kv.make_kv_cache(8, BS, max_model_len=64)
    out, _ = admit(state, "a", list(range(6)))  # one full (hashed) block, one partial
    state = kv.free(out.state, "a")
    assert bp.free_order(state.pool) == (2, 3, 4, 5, 6, 7, 1)
    kv.check_invariants(state)
    lost = replace(state, pool=replace(state.pool, split=bp.NULL_BLOCK))
    with pytest.raises(InvariantError, match="block 2, behind the never-used blocks, holds no"):
        kv.check_invariants(lost)
    hashed = replace(state, pool=replace(state.pool, split=1))
    with pytest.raises(InvariantError, match="block 1, ahead of the never-used blocks, holds a"):
        kv.check_invariants(hashed)
    # Used up the never-used blocks: unhashed 2 first, hashed 1 last, no split.
    state = kv.allocate_slots(state, "b", 24, 0).state
    state = kv.free(state, "b")
    assert state.pool.split == bp.NULL_BLOCK
    assert bp.free_order(state.pool) == (7, 6, 5, 4, 3, 2, 1)
    kv.check_invariants(state)


def test_pinning_a_free_cached_block_revives_it():
    state = kv.make_kv_cache(8, BS, max_model_len=64)
    out, _ = admit(state, "a", list(range(8)))
    state = kv.pin(kv.free(out.state, "a"), [1])
    assert 1 not in bp.free_order(state.pool) and kv.num_free_blocks(state) == 6
    kv.check_invariants(state, extra_holders={1: 1})


def misuse_cases():
    def cached_on_existing(s):
        return kv.allocate_slots(s, "a", 1, 8, (1,))

    return [
        (lambda s: kv.free(s, "nope"), "unknown request 'nope'"),
        (lambda s: kv.blocks_of(s, "nope"), "unknown request"),
        (lambda s: kv.allocate_slots(s, "b", 65, 0), "exceeds max_model_len=64"),
        (lambda s: kv.allocate_slots(s, "a", 60, 8), "exceeds max_model_len=64"),
        (lambda s: kv.allocate_slots(s, "b", -1, 0), "num_new_tokens=-1"),
        (lambda s: kv.allocate_slots(s, "b", 1, 0, lookahead=-2), "lookahead=-2"),
        (lambda s: kv.allocate_slots(s, "b", 1, 4), "stale computed count"),
        (lambda s: kv.allocate_slots(s, "a", 1, 12), "holds only 2 blocks"),
        (cached_on_existing, "already holds blocks"),
        (lambda s: kv.allocate_slots(s, "b", 1, 0, (1, 1)), "repeated cached blocks"),
        (lambda s: kv.allocate_slots(s, "b", 1, 0, (3,)), "holds no cached prefix"),
        (lambda s: kv.allocate_slots(s, "b", 1, 0, (2,), block_hashes=(b"z" * 32,)), "block 0 is"),
        (lambda s: kv.unpin(s, [1, 1, 1]), "ref count 0"),
        (lambda s: kv.pin(s, [1, 30]), "never handed out"),
        (lambda s: kv.find_cached_prefix(s, Req((), -1)), "num_tokens=-1"),
    ]


@pytest.mark.parametrize(("action", "message"), misuse_cases())
def test_misuse_raises_and_leaves_the_state_as_it_was(action, message):
    out, _ = admit(kv.make_kv_cache(32, BS, max_model_len=64), "a", list(range(8)))
    out = kv.allocate_slots(out.state, "x", 4, 0)  # block 3, never hashed
    state = kv.free(kv.allocate_slots(out.state, "y", 2, 0).state, "y")
    before = snapshot(state)
    with pytest.raises(ValueError, match=message):
        action(state)
    assert snapshot(state) == before
    kv.check_invariants(state)


def test_bad_configuration_is_rejected():
    with pytest.raises(kv.KVCacheError, match="max_model_len=0"):
        kv.make_kv_cache(8, BS, max_model_len=0)
    with pytest.raises(kv.KVCacheError, match="enable_prefix_caching=1"):
        kv.make_kv_cache(8, BS, max_model_len=8, enable_prefix_caching=1)
