"""Whole-state invariant check of a KV cache, for property tests of every owner of block refs.

O(num_blocks): meant for tests and notebooks, never for the engine loop.
"""

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from runtime.core import block_pool as bp

if TYPE_CHECKING:
    from runtime.core.kv_cache import KVCache


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
            hashed = block in pool.hash_of
            if hashed != (position < num_cached):
                _fail(
                    f"request {request_id!r}: block {block} at position {position} is "
                    f"{'' if hashed else 'not '}hashed but num_cached={num_cached}"
                )
    for block, count in holders.items():
        if not bp.NULL_BLOCK < block < pool.next_fresh:
            _fail(f"held block {block} is null, out of range or never handed out")
        if pool.refs.get(block, 0) != count:
            _fail(f"block {block}: ref count {pool.refs.get(block, 0)} but {count} holders")
    for block, count in pool.refs.items():
        if holders.get(block, 0) != count:
            _fail(f"block {block}: ref count {count} but {holders.get(block, 0)} holders")
    _check_hash_index(pool)


def _check_free_list(pool: bp.BlockPool) -> None:
    if not 1 <= pool.next_fresh <= pool.num_blocks:
        _fail(f"next_fresh={pool.next_fresh} outside 1..{pool.num_blocks}")
    listed, block, before = set(), pool.head, bp.NULL_BLOCK
    while block != bp.NULL_BLOCK:
        if block in listed or len(listed) >= pool.num_blocks:
            _fail(f"free list cycles at block {block}")
        if pool.prv.get(block, bp.NULL_BLOCK) != before:
            _fail(f"free list: prev of {block} is {pool.prv.get(block)}, expected {before}")
        listed.add(block)
        before, block = block, pool.nxt.get(block, bp.NULL_BLOCK)
    if before != pool.tail:
        _fail(f"free list ends at {before} but tail is {pool.tail}")
    if len(pool.nxt) != max(0, len(listed) - 1) or len(pool.prv) != max(0, len(listed) - 1):
        _fail(f"free list maps hold stale links: {len(pool.nxt)} next, {len(pool.prv)} prev")
    num_fresh = pool.num_blocks - pool.next_fresh
    if pool.num_free != num_fresh + len(listed):
        _fail(f"num_free={pool.num_free} but {num_fresh} fresh + {len(listed)} listed blocks")
    for block in range(1, pool.next_fresh):
        if (block in listed) == (block in pool.refs):
            _fail(f"block {block} must be free xor referenced; free={block in listed}")
    for block, count in pool.refs.items():
        if count < 1 or not bp.NULL_BLOCK < block < pool.next_fresh:
            _fail(f"ref entry {block}: {count} is not a positive count of a handed-out block")


def _check_hash_index(pool: bp.BlockPool) -> None:
    indexed = 0
    for block_hash, blocks in pool.index.items():
        if not blocks or len(set(blocks)) != len(blocks):
            _fail(f"hash index entry {block_hash.hex()[:16]}.. holds {blocks}")
        for block in blocks:
            if pool.hash_of.get(block) != block_hash:
                _fail(f"hash index names block {block}, which holds another hash")
        indexed += len(blocks)
    if indexed != len(pool.hash_of):
        _fail(f"{len(pool.hash_of)} hashed blocks but {indexed} hash index entries")
    for block in pool.hash_of:
        if not bp.NULL_BLOCK < block < pool.next_fresh:
            _fail(f"block {block} is hashed but was never handed out")


def _fail(message: str) -> None:
    raise InvariantError(message)
