"""Encoder cache: shared entries, references, LRU eviction, and events from the final state."""

import pytest

from runtime.core.encoder import encoder_cache as ec


def _alloc(cache, content_hash, owner, size):
    assert ec.can_allocate(cache, size)
    cache = ec.allocate(cache, content_hash, owner, size)
    ec.check_invariants(cache)
    return cache


def test_hit_shares_an_entry_and_repeated_items_stay_referenced():
    cache = _alloc(ec.make_encoder_cache(10), "a", ("r1", 0), 4)
    cache = ec.add_ref(cache, "a", ("r2", 0))
    cache = ec.add_ref(cache, "a", ("r2", 3))  # the same image twice in r2
    cache = ec.release(cache, [("a", ("r1", 0)), ("a", ("r2", 0))])
    assert cache.freeable == () and cache.entries["a"].refs == {("r2", 3)}
    cache = ec.release(cache, [("a", ("r2", 3))])
    assert cache.freeable == ("a",) and cache.num_freeable == 4 and ec.is_cached(cache, "a")
    ec.check_invariants(cache)


def test_referenced_entries_are_never_evicted():
    cache = _alloc(ec.make_encoder_cache(10), "a", ("r1", 0), 6)
    assert not ec.can_allocate(cache, 5)
    with pytest.raises(ec.EncoderCacheError, match="5 embeddings needed but only 4 free"):
        ec.allocate(cache, "b", ("r2", 0), 5)
    assert set(cache.entries) == {"a"}


def test_eviction_is_lru_and_only_when_space_is_needed():
    cache = ec.make_encoder_cache(10)
    for h in "abc":
        cache = _alloc(cache, h, (h, 0), 3)
    cache, computed, freed = ec.end_step(cache)
    assert computed == ("a", "b", "c") and freed == ()
    cache = ec.release(cache, [("b", ("b", 0)), ("a", ("a", 0)), ("c", ("c", 0))])
    assert cache.freeable == ("b", "a", "c")
    cache = _alloc(cache, "d", ("d", 0), 1)  # fits in the free slot: nothing evicted
    assert set(cache.entries) == {"a", "b", "c", "d"}
    cache = ec.add_ref(cache, "a", ("x", 1))  # a hit revives "a"
    cache = _alloc(cache, "e", ("e", 0), 4)  # evicts b then c, the least recently freed
    assert set(cache.entries) == {"a", "d", "e"} and cache.freeable == ()
    cache, computed, freed = ec.end_step(cache)
    assert computed == ("d", "e") and freed == ("b", "c")
    assert cache.evicted == () and cache.fresh == frozenset()


def test_same_step_evict_and_reallocate_is_not_freed():
    # failure-modes §3 (#52482): evict freeable a and b, re-allocate a in the same step.
    cache = ec.make_encoder_cache(4)
    cache = _alloc(cache, "a", ("r1", 0), 2)
    cache = _alloc(cache, "b", ("r2", 0), 2)
    cache, _, _ = ec.end_step(cache)
    cache = ec.release(cache, [("a", ("r1", 0)), ("b", ("r2", 0))])
    cache = _alloc(cache, "c", ("r3", 0), 4)  # evicts a and b
    cache = ec.release(cache, [("c", ("r3", 0))])  # (its user preempted in the same step)
    cache = _alloc(cache, "a", ("r4", 0), 2)  # evicts c (never computed), re-allocates a
    cache, computed, freed = ec.end_step(cache)
    assert freed == ("b",)
    assert computed == ("a",)
    assert set(cache.entries) == {"a"} and cache.num_free == 2


def test_fresh_entry_whose_users_left_in_the_same_step_is_dropped():
    cache = _alloc(ec.make_encoder_cache(4), "a", ("r1", 0), 3)
    cache = ec.release(cache, [("a", ("r1", 0))])
    cache, computed, freed = ec.end_step(cache)
    assert computed == () and freed == () and not ec.is_cached(cache, "a")
    assert cache.num_free == 4 and cache.freeable == ()
    ec.check_invariants(cache)


def test_misuse_raises_and_leaves_state_valid():
    cache = _alloc(ec.make_encoder_cache(4), "a", ("r1", 0), 2)
    with pytest.raises(ec.EncoderCacheError, match="already cached"):
        ec.allocate(cache, "a", ("r2", 0), 2)
    with pytest.raises(ec.EncoderCacheError, match="not cached"):
        ec.add_ref(cache, "zz", ("r2", 0))
    with pytest.raises(ec.EncoderCacheError, match="already references"):
        ec.add_ref(cache, "a", ("r1", 0))
    with pytest.raises(ec.EncoderCacheError, match="holds no reference"):
        ec.release(cache, [("a", ("r2", 0))])
    with pytest.raises(ec.EncoderCacheError, match="num_embeds=0"):
        ec.allocate(cache, "b", ("r2", 0), 0)
    with pytest.raises(ec.EncoderCacheError, match="capacity=-1"):
        ec.make_encoder_cache(-1)
    ec.check_invariants(cache)
    assert cache.entries["a"].refs == {("r1", 0)}
