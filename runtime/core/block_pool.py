"""Pool of KV-cache blocks: reference counts, LRU free order and the prefix-hash index.

A `BlockPool` is an immutable value; every transition returns a new pool and shares everything it
did not change, so the cost of a transition is proportional to the blocks it touches, never to
`num_blocks`.

The eviction order is two parts, head first:
1. the "fresh" range `next_fresh .. num_blocks - 1`: blocks never handed out yet, kept as a range so
   that making a pool of any size is O(1);
2. a doubly linked list (two persistent maps) of blocks freed since, oldest first (LRU).
Freed blocks are appended to the tail in the order the caller gives, so a request that frees its
table tail-first has its shared prefix evicted last.
"""

from collections.abc import Iterable
from dataclasses import dataclass, replace

from immutables import Map

BlockHash = bytes
NULL_BLOCK = 0
HASH_NBYTES = 32


class BlockPoolError(ValueError):
    """Misuse of a block pool; the pool passed in is left as it was."""


@dataclass(frozen=True, slots=True, repr=False)
class BlockPool:
    num_blocks: int
    block_size: int
    # block id -> ref count; only blocks with a count above 0 are present.
    refs: Map
    # Blocks next_fresh.. were never handed out; they head the eviction order.
    next_fresh: int
    # The freed list; NULL_BLOCK doubles as "none" since it is never on the list.
    head: int
    tail: int
    nxt: Map
    prv: Map
    num_free: int
    # block id -> its hash, and hash -> blocks holding it (several blocks may hold equal content,
    # e.g. two requests that computed the same prefix at the same time; tables stay append-only).
    hash_of: Map
    index: Map

    def __repr__(self) -> str:
        # The maps can hold 100k+ entries; a summary keeps notebooks and test failures readable.
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_free={self.num_free}, num_held={len(self.refs)}, num_cached={len(self.hash_of)})"
        )


def make_block_pool(num_blocks: int, block_size: int) -> BlockPool:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
        raise BlockPoolError(
            f"num_blocks={num_blocks!r}: expected an int >= 2 (block 0 is the reserved null block)"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise BlockPoolError(f"block_size={block_size!r}: expected an int >= 1")
    empty = Map()
    return BlockPool(
        num_blocks=num_blocks,
        block_size=block_size,
        refs=empty,
        next_fresh=1,
        head=NULL_BLOCK,
        tail=NULL_BLOCK,
        nxt=empty,
        prv=empty,
        num_free=num_blocks - 1,
        hash_of=empty,
        index=empty,
    )


# ---------------------------------------------------------------- queries


def num_free_blocks(pool: BlockPool) -> int:
    return pool.num_free


def ref_count(pool: BlockPool, block_id: int) -> int:
    _check_id(pool, block_id)
    return pool.refs.get(block_id, 0)


def block_hash_of(pool: BlockPool, block_id: int) -> BlockHash | None:
    _check_id(pool, block_id)
    return pool.hash_of.get(block_id)


def lookup_cached(pool: BlockPool, block_hash: BlockHash) -> int | None:
    """A block holding `block_hash` (the earliest registered), or None."""
    holders = pool.index.get(block_hash)
    return None if holders is None else holders[0]


def num_cached_blocks(pool: BlockPool) -> int:
    return len(pool.hash_of)


def free_order(pool: BlockPool) -> tuple[int, ...]:
    """Every free block in eviction order, head first. O(num_free); for tests and notebooks."""
    order = list(range(pool.next_fresh, pool.num_blocks))
    block = pool.head
    while block != NULL_BLOCK:
        order.append(block)
        block = pool.nxt.get(block, NULL_BLOCK)
    return tuple(order)


def is_free(pool: BlockPool, block_id: int) -> bool:
    _check_id(pool, block_id)
    return block_id not in pool.refs


# ---------------------------------------------------------------- transitions


def take_free_blocks(pool: BlockPool, n: int) -> tuple[BlockPool, tuple[int, ...]]:
    """Hand out `n` blocks from the eviction head with ref count 1; evicted blocks lose their hash."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise BlockPoolError(f"take_free_blocks: n={n!r}, expected an int >= 0")
    if n > pool.num_free:
        raise BlockPoolError(f"take_free_blocks: {n} blocks asked for, only {pool.num_free} free")
    if n == 0:
        return pool, ()
    num_fresh = min(n, pool.num_blocks - pool.next_fresh)
    taken = list(range(pool.next_fresh, pool.next_fresh + num_fresh))
    head, tail, nxt, prv = pool.head, pool.tail, pool.nxt, pool.prv
    hash_of, index = pool.hash_of, pool.index
    num_old = n - num_fresh
    if num_old:
        old = _pop_head(pool, num_old)
        taken.extend(old)
        nxt_m, prv_m = nxt.mutate(), prv.mutate()
        for block in old:
            nxt_m.pop(block, None)
            prv_m.pop(block, None)
        head = nxt.get(old[-1], NULL_BLOCK)
        if head == NULL_BLOCK:
            tail = NULL_BLOCK
        else:
            del prv_m[head]
        nxt, prv = nxt_m.finish(), prv_m.finish()
        hash_of, index = _drop_hashes(hash_of, index, old)
    refs_m = pool.refs.mutate()
    for block in taken:
        refs_m[block] = 1
    return (
        replace(
            pool,
            refs=refs_m.finish(),
            next_fresh=pool.next_fresh + num_fresh,
            head=head,
            tail=tail,
            nxt=nxt,
            prv=prv,
            num_free=pool.num_free - n,
            hash_of=hash_of,
            index=index,
        ),
        tuple(taken),
    )


def touch(pool: BlockPool, block_ids: Iterable[int]) -> BlockPool:
    """Add one reference to each block (repeats add several); a free block leaves the free list."""
    refs_m, nxt_m, prv_m = pool.refs.mutate(), pool.nxt.mutate(), pool.prv.mutate()
    head, tail, num_free = pool.head, pool.tail, pool.num_free
    for block in block_ids:
        _check_id(pool, block)
        if block >= pool.next_fresh:
            raise BlockPoolError(
                f"touch: block {block} was never handed out, so nothing can hold or reuse it"
            )
        count = refs_m.get(block, 0)
        refs_m[block] = count + 1
        if count:
            continue
        before = prv_m.pop(block, NULL_BLOCK)
        after = nxt_m.pop(block, NULL_BLOCK)
        if before == NULL_BLOCK:
            head = after
        elif after == NULL_BLOCK:
            del nxt_m[before]
        else:
            nxt_m[before] = after
        if after == NULL_BLOCK:
            tail = before
        elif before == NULL_BLOCK:
            del prv_m[after]
        else:
            prv_m[after] = before
        num_free -= 1
    return replace(
        pool,
        refs=refs_m.finish(),
        head=head,
        tail=tail,
        nxt=nxt_m.finish(),
        prv=prv_m.finish(),
        num_free=num_free,
    )


def release(pool: BlockPool, block_ids: Iterable[int]) -> BlockPool:
    """Drop one reference per id; blocks reaching 0 join the free tail in the order given."""
    refs_m, nxt_m, prv_m = pool.refs.mutate(), pool.nxt.mutate(), pool.prv.mutate()
    tail, head, num_free = pool.tail, pool.head, pool.num_free
    for block in block_ids:
        _check_id(pool, block)
        count = refs_m.get(block, 0)
        if count == 0:
            raise BlockPoolError(
                f"release: block {block} has ref count 0 (double free, or never handed out)"
            )
        if count > 1:
            refs_m[block] = count - 1
            continue
        del refs_m[block]
        if tail == NULL_BLOCK:
            head = block
        else:
            nxt_m[tail] = block
            prv_m[block] = tail
        tail = block
        num_free += 1
    return replace(
        pool,
        refs=refs_m.finish(),
        head=head,
        tail=tail,
        nxt=nxt_m.finish(),
        prv=prv_m.finish(),
        num_free=num_free,
    )


def set_block_hash(pool: BlockPool, block_id: int, block_hash: BlockHash) -> BlockPool:
    return cache_blocks(pool, (block_id,), (block_hash,))


def cache_blocks(
    pool: BlockPool, block_ids: Iterable[int], block_hashes: Iterable[BlockHash]
) -> BlockPool:
    """Register full, referenced blocks under their hashes (batched `set_block_hash`)."""
    hash_m, index_m = pool.hash_of.mutate(), pool.index.mutate()
    block_ids, block_hashes = tuple(block_ids), tuple(block_hashes)
    if len(block_ids) != len(block_hashes):
        raise BlockPoolError(
            f"cache_blocks: {len(block_ids)} block ids but {len(block_hashes)} hashes"
        )
    for block, block_hash in zip(block_ids, block_hashes, strict=True):
        _check_id(pool, block)
        if not isinstance(block_hash, bytes) or len(block_hash) != HASH_NBYTES:
            raise BlockPoolError(
                f"block hash {block_hash!r}: expected {HASH_NBYTES} bytes (a sha256 digest)"
            )
        if block not in pool.refs:
            raise BlockPoolError(f"set_block_hash: block {block} is free; only held blocks fill")
        if block in hash_m:
            raise BlockPoolError(f"set_block_hash: block {block} already has a hash")
        hash_m[block] = block_hash
        index_m[block_hash] = index_m.get(block_hash, ()) + (block,)
    return replace(pool, hash_of=hash_m.finish(), index=index_m.finish())


# ---------------------------------------------------------------- internals


def _check_id(pool: BlockPool, block_id: object) -> None:
    if (
        isinstance(block_id, bool)
        or not isinstance(block_id, int)
        or not NULL_BLOCK < block_id < pool.num_blocks
    ):
        raise BlockPoolError(
            f"block id {block_id!r}: expected an int in 1..{pool.num_blocks - 1} "
            f"(block {NULL_BLOCK} is the reserved null block)"
        )


def _pop_head(pool: BlockPool, n: int) -> list[int]:
    taken, block, nxt = [], pool.head, pool.nxt
    for _ in range(n):
        taken.append(block)
        block = nxt.get(block, NULL_BLOCK)
    return taken


def _drop_hashes(hash_of: Map, index: Map, blocks: list[int]) -> tuple[Map, Map]:
    if not hash_of:
        return hash_of, index
    hash_m, index_m = hash_of.mutate(), index.mutate()
    for block in blocks:
        block_hash = hash_m.pop(block, None)
        if block_hash is None:
            continue
        holders = index_m[block_hash]
        if len(holders) == 1:
            del index_m[block_hash]
        else:
            index_m[block_hash] = tuple(b for b in holders if b != block)
    return hash_m.finish(), index_m.finish()
