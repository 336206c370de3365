"""Whole-state invariant check of a KV cache, for property tests of every owner of block refs.

O(num_blocks): meant for tests and notebooks, never for the engine loop.
"""

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from runtime.core.kv import block_pool as bp
from runtime.core.kv import versioned_store as vs

if TYPE_CHECKING:
    from runtime.core.kv.kv_cache import KVCache


class InvariantError(AssertionError):
    """A KV-cache state that no sequence of valid transitions should produce."""


def check_invariants(
    state: "KVCache", extra_holders: Mapping[int, int] | Iterable[int] = ()
) -> None:
    """Raise `InvariantError` naming the first broken rule.

    extra_holders: the references other owners (KV jobs) hold, as a multiset of block ids: either
    a mapping block id -> count (e.g. a `Counter`) or an iterable with one entry per reference.
    """
    pool = state.pool
    refs, _, _, hash_of, _, _ = vs.read(pool.data)
    holders = Counter(extra_holders) if not isinstance(extra_holders, Mapping) else extra_holders
    holders = Counter({block: n for block, n in holders.items() if n})
    _check_free_list(pool)
    if set(state.tables) != set(state.num_cached):
        _fail(f"tables {sorted(state.tables)} and num_cached {sorted(state.num_cached)} differ")
    for request_id, table in state.tables.items():
        if len(set(table)) != len(table):
            _fail(f"request {request_id!r} holds a block twice: {table}")
        holders.update(table)
        num_cached = state.num_cached[request_id]
        if not 0 <= num_cached <= len(table):
            _fail(f"request {request_id!r}: num_cached={num_cached} outside 0..{len(table)}")
        for position, block in enumerate(table):
            hashed = block in hash_of
            if hashed != (position < num_cached):
                _fail(
                    f"request {request_id!r}: block {block} at position {position} is "
                    f"{'' if hashed else 'not '}hashed but num_cached={num_cached}"
                )
    for block, count in holders.items():
        if not bp.NULL_BLOCK < block < pool.next_fresh:
            _fail(f"held block {block} is null, out of range or never handed out")
        if refs.get(block, 0) != count:
            _fail(f"block {block}: ref count {refs.get(block, 0)} but {count} holders")
    for block, count in refs.items():
        if holders.get(block, 0) != count:
            _fail(f"block {block}: ref count {count} but {holders.get(block, 0)} holders")
    _check_hash_index(pool)


def _check_free_list(pool: bp.BlockPool) -> None:
    refs, nxt, prv, _, _, _ = vs.read(pool.data)
    if not 1 <= pool.next_fresh <= pool.num_blocks:
        _fail(f"next_fresh={pool.next_fresh} outside 1..{pool.num_blocks}")
    listed, block, before = set(), pool.head, bp.NULL_BLOCK
    while block != bp.NULL_BLOCK:
        if block in listed or len(listed) >= pool.num_blocks:
            _fail(f"free list cycles at block {block}")
        if prv.get(block, bp.NULL_BLOCK) != before:
            _fail(f"free list: prev of {block} is {prv.get(block)}, expected {before}")
        listed.add(block)
        before, block = block, nxt.get(block, bp.NULL_BLOCK)
    if before != pool.tail:
        _fail(f"free list ends at {before} but tail is {pool.tail}")
    _check_free_order(pool, listed)
    if len(nxt) != max(0, len(listed) - 1) or len(prv) != max(0, len(listed) - 1):
        _fail(f"free list maps hold stale links: {len(nxt)} next, {len(prv)} prev")
    num_fresh = pool.num_blocks - pool.next_fresh
    if pool.num_free != num_fresh + len(listed):
        _fail(f"num_free={pool.num_free} but {num_fresh} fresh + {len(listed)} listed blocks")
    for block in range(1, pool.next_fresh):
        if (block in listed) == (block in refs):
            _fail(f"block {block} must be free xor referenced; free={block in listed}")
    for block, count in refs.items():
        if count < 1 or not bp.NULL_BLOCK < block < pool.next_fresh:
            _fail(f"ref entry {block}: {count} is not a positive count of a handed-out block")


def _check_free_order(pool: bp.BlockPool, listed: set[int]) -> None:
    """vLLM's free queue: blocks freed without a hash, then never-used ones, then blocks freed
    with a hash. `split` (the last of the first group) is set only while never-used ones last."""
    _, nxt, _, hash_of, _, _ = vs.read(pool.data)
    num_fresh = pool.num_blocks - pool.next_fresh
    if pool.split != bp.NULL_BLOCK and (pool.split not in listed or not num_fresh):
        _fail(f"split={pool.split} but it is not listed or no never-used block is left")
    ahead_of_fresh = pool.split != bp.NULL_BLOCK
    seen_hashed, block = False, pool.head
    while block != bp.NULL_BLOCK:
        hashed = block in hash_of
        if ahead_of_fresh and hashed:
            _fail(f"free list: block {block}, ahead of the never-used blocks, holds a hash")
        if not ahead_of_fresh and num_fresh and not hashed:
            _fail(f"free list: block {block}, behind the never-used blocks, holds no hash")
        if seen_hashed and not hashed:
            _fail(f"free list: block {block} holds no hash but comes after a hashed block")
        seen_hashed = seen_hashed or hashed
        if block == pool.split:
            ahead_of_fresh = False
        block = nxt.get(block, bp.NULL_BLOCK)


def _check_hash_index(pool: bp.BlockPool) -> None:
    _, _, _, hash_of, index, dup = vs.read(pool.data)
    chained = 0
    for block_hash, first in index.items():
        block, seen = first, set()
        while block is not None:
            if block in seen:
                _fail(f"holders of hash {block_hash.hex()[:16]}.. cycle at block {block}")
            seen.add(block)
            if hash_of.get(block) != block_hash:
                _fail(f"hash index names block {block}, which holds another hash")
            block = dup.get(block)
        chained += len(seen)
    if chained != len(hash_of):
        _fail(f"{len(hash_of)} hashed blocks but {chained} reachable from the hash index")
    if len(dup) != chained - len(index):
        _fail(f"{len(dup)} duplicate-holder links for {chained - len(index)} duplicate holders")
    for block in hash_of:
        if not bp.NULL_BLOCK < block < pool.next_fresh:
            _fail(f"block {block} is hashed but was never handed out")


def _fail(message: str) -> None:
    raise InvariantError(message)
