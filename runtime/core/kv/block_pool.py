"""Pool of KV-cache blocks: reference counts, LRU free order and the prefix-hash index.

A `BlockPool` is an immutable value; every transition returns a new pool, at a cost proportional
to the blocks it touches, never to `num_blocks` (the per-block maps live in a
`versioned_store`, which keeps every version valid and makes the newest one O(1) to update).
Per-block fields are dense slots indexed by block id, so making a pool is one O(num_blocks)
zero-fill (memset speed), not a transition.

The eviction order (vLLM's free block queue) is three parts, head first:
1. blocks freed holding no hash (they can never be a prefix hit), most recently freed first;
2. the "fresh" range `next_fresh .. num_blocks - 1`: blocks never handed out yet, kept as a range so
   that making a pool of any size is O(1);
3. blocks freed holding a hash (cached prefixes), least recently freed first (LRU).
Parts 1 and 3 are one doubly linked list; `split` names the last block of part 1 (the fresh range
sits right after it). As in vLLM's `BlockPool.free_blocks`, one `release` call puts the blocks it
frees that hold no hash at the front, in the order given, and those holding one at the back, in
the order given; a request that frees its table tail-first has its shared prefix evicted last.
Once the fresh range is used up, part 1 is just the head of the list and `split` is unused.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.core.kv import versioned_store as vs

BlockHash = bytes
NULL_BLOCK = 0
HASH_NBYTES = 32

# Tables of the versioned store. REFS, NXT, PRV are `IntSlots` and HASH_OF an `ObjSlots` indexed
# by block id; INDEX and DUP are dicts. NXT / PRV link the freed list (NULL_BLOCK, i.e. 0, doubles
# as "none": it is never on the list). Several blocks may hold equal
# content (two requests that computed the same prefix at once; tables stay append-only): INDEX
# names the earliest registered holder of a hash and DUP chains the others in registration order.
REFS, NXT, PRV, HASH_OF, INDEX, DUP = range(6)


class BlockPoolError(ValueError):
    """Misuse of a block pool; the pool passed in is left as it was."""


@dataclass(frozen=True, slots=True, repr=False)
class BlockPool:
    num_blocks: int
    block_size: int
    # Blocks next_fresh.. were never handed out; they head the eviction order.
    next_fresh: int
    head: int
    tail: int
    # The last listed block ahead of the fresh range (NULL_BLOCK: none, or no fresh range left).
    split: int
    num_free: int
    num_cached: int
    data: vs.Version

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_free={self.num_free}, num_cached={num_cached_blocks(self)})"
        )


def make_block_pool(num_blocks: int, block_size: int) -> BlockPool:
    if not _is_int(num_blocks) or num_blocks < 2:
        raise BlockPoolError(
            f"num_blocks={num_blocks!r}: expected an int >= 2 (block 0 is the reserved null block)"
        )
    if not _is_int(block_size) or block_size < 1:
        raise BlockPoolError(f"block_size={block_size!r}: expected an int >= 1")
    return BlockPool(
        num_blocks=num_blocks,
        block_size=block_size,
        next_fresh=1,
        head=NULL_BLOCK,
        tail=NULL_BLOCK,
        split=NULL_BLOCK,
        num_free=num_blocks - 1,
        num_cached=0,
        data=vs.new_version_of(
            (
                vs.IntSlots(num_blocks),
                vs.IntSlots(num_blocks),
                vs.IntSlots(num_blocks),
                vs.ObjSlots(num_blocks),
                {},
                {},
            )
        ),
    )


# ---------------------------------------------------------------- queries


def num_free_blocks(pool: BlockPool) -> int:
    return pool.num_free


def ref_count(pool: BlockPool, block_id: int) -> int:
    _check_id(pool, block_id)
    return vs.read(pool.data)[REFS][block_id]


def is_free(pool: BlockPool, block_id: int) -> bool:
    return ref_count(pool, block_id) == 0


def block_hash_of(pool: BlockPool, block_id: int) -> BlockHash | None:
    _check_id(pool, block_id)
    return vs.read(pool.data)[HASH_OF][block_id]


def lookup_cached(pool: BlockPool, block_hash: BlockHash) -> int | None:
    """The earliest registered block holding `block_hash`, or None."""
    return vs.read(pool.data)[INDEX].get(block_hash)


def cached_run(pool: BlockPool, block_hashes: Sequence[BlockHash], limit: int) -> tuple[int, ...]:
    """Blocks holding the first hashes of a chain, up to the first miss or `limit` blocks."""
    index = vs.read(pool.data)[INDEX]
    hits = []
    for position in range(min(limit, len(block_hashes))):
        block = index.get(block_hashes[position])
        if block is None:
            break
        hits.append(block)
    return tuple(hits)


def num_cached_blocks(pool: BlockPool) -> int:
    return pool.num_cached


def free_order(pool: BlockPool) -> tuple[int, ...]:
    """Every free block in eviction order, head first. O(num_free); for tests and notebooks."""
    nxt = vs.read(pool.data)[NXT]
    order = []
    block = pool.head
    if pool.split != NULL_BLOCK:
        while True:
            order.append(block)
            if block == pool.split:
                break
            block = nxt[block]
        block = nxt[block]
    order.extend(range(pool.next_fresh, pool.num_blocks))
    while block != NULL_BLOCK:
        order.append(block)
        block = nxt[block]
    return tuple(order)


# ---------------------------------------------------------------- transitions


def take_free_blocks(
    pool: BlockPool, n: int, block_hashes: Sequence[BlockHash] = ()
) -> tuple[BlockPool, tuple[int, ...]]:
    """Hand out `n` blocks from the eviction head with ref count 1; evicted blocks lose their hash.

    The first `len(block_hashes)` blocks handed out are registered under those hashes, as
    `cache_blocks` would (one pass: newly allocated full blocks are the common case).
    """
    if not _is_int(n) or n < 0:
        raise BlockPoolError(f"take_free_blocks: n={n!r}, expected an int >= 0")
    if n > pool.num_free:
        raise BlockPoolError(f"take_free_blocks: {n} blocks asked for, only {pool.num_free} free")
    if len(block_hashes) > n:
        raise BlockPoolError(
            f"take_free_blocks: {len(block_hashes)} hashes for {n} blocks; only taken blocks fill"
        )
    _check_hashes(block_hashes)
    if n == 0:
        return pool, ()
    head, tail, split, num_cached = pool.head, pool.tail, pool.split, pool.num_cached
    taken = []
    tx = vs.Transaction(pool.data)
    refs, nxt, prv, hash_of, index, dup = tx.tables
    log = tx.log
    try:
        # Blocks freed without a hash come first; they hold nothing to evict.
        while split != NULL_BLOCK and len(taken) < n:
            block = head
            head = nxt[block]
            log += (REFS, block, 0)
            refs[block] = 1
            if head == NULL_BLOCK:
                tail = NULL_BLOCK
            else:
                log += (NXT, block, head, PRV, head, block)
                nxt[block] = NULL_BLOCK
                prv[head] = NULL_BLOCK
            if block == split:
                split = NULL_BLOCK
            taken.append(block)
        num_fresh = min(n - len(taken), pool.num_blocks - pool.next_fresh)
        for block in range(pool.next_fresh, pool.next_fresh + num_fresh):
            log += (REFS, block, 0)
            refs[block] = 1
            taken.append(block)
        for _ in range(n - len(taken)):
            block = head
            head = nxt[block]
            block_hash = hash_of[block]
            # The busy-engine case, a sole holder of a hash evicted mid-list, in one log append.
            if (
                head != NULL_BLOCK
                and block_hash is not None
                and not dup
                and index[block_hash] == block
            ):
                log += (
                    *(NXT, block, head, PRV, head, block, REFS, block, 0),
                    *(HASH_OF, block, block_hash, INDEX, block_hash, block),
                )
                nxt[block] = NULL_BLOCK
                prv[head] = NULL_BLOCK
                refs[block] = 1
                hash_of[block] = None
                del index[block_hash]
                num_cached -= 1
                taken.append(block)
                continue
            if head == NULL_BLOCK:
                tail = NULL_BLOCK
            else:
                log += (NXT, block, head, PRV, head, block)
                nxt[block] = NULL_BLOCK
                prv[head] = NULL_BLOCK
            log += (REFS, block, 0)
            refs[block] = 1
            if block_hash is not None:
                log += (HASH_OF, block, block_hash)
                hash_of[block] = None
                num_cached -= 1
                if block in dup or index[block_hash] != block:
                    _drop_shared_hash(tx, block, block_hash)
                else:
                    log += (INDEX, block_hash, block)
                    del index[block_hash]
            taken.append(block)
        _register(tx, taken, block_hashes)
    except BaseException:
        tx.abort()
        raise
    new_pool = BlockPool(
        pool.num_blocks,
        pool.block_size,
        pool.next_fresh + num_fresh,
        head,
        tail,
        split,
        pool.num_free - n,
        num_cached + len(block_hashes),
        tx.commit(),
    )
    return new_pool, tuple(taken)


def touch(pool: BlockPool, block_ids: Iterable[int]) -> BlockPool:
    """Add one reference to each block (repeats add several); a free block leaves the free list."""
    head, tail, split, num_free = pool.head, pool.tail, pool.split, pool.num_free
    tx = vs.Transaction(pool.data)
    refs, nxt, prv, _, _, _ = tx.tables
    log = tx.log
    try:
        for block in block_ids:
            _check_id(pool, block)
            if block >= pool.next_fresh:
                raise BlockPoolError(
                    f"touch: block {block} was never handed out, so nothing can hold or reuse it"
                )
            count = refs[block]
            log += (REFS, block, count)
            refs[block] = count + 1
            if count:
                continue
            before = prv[block]
            after = nxt[block]
            if block == split:
                split = before
            # Unlinking `block` sets before.next = after and after.prev = before (0 = none).
            if before == NULL_BLOCK:
                head = after
            else:
                log += (PRV, block, before, NXT, before, block)
                prv[block] = NULL_BLOCK
                nxt[before] = after
            if after == NULL_BLOCK:
                tail = before
            else:
                log += (NXT, block, after, PRV, after, block)
                nxt[block] = NULL_BLOCK
                prv[after] = before
            num_free -= 1
    except BaseException:
        tx.abort()
        raise
    return _relinked(pool, head, tail, split, num_free, tx.commit())


def release(pool: BlockPool, block_ids: Iterable[int]) -> BlockPool:
    """Drop one reference per id. Blocks reaching 0 rejoin the free queue as in vLLM's
    `BlockPool.free_blocks`: those holding no hash at the front (reused first, since they can
    never be a prefix hit), those holding one at the back (LRU), each group in the order given."""
    head, tail, split = pool.head, pool.tail, pool.split
    num_free, limit = pool.num_free, pool.num_blocks
    # Unhashed blocks go ahead of the fresh range, so they mark its place while it lasts.
    fresh_left = pool.next_fresh < limit
    # The last block this call put at the front (the next one goes right after it).
    front = NULL_BLOCK
    tx = vs.Transaction(pool.data)
    refs, nxt, prv, hash_of, _, _ = tx.tables
    log = tx.log
    try:
        for block in block_ids:
            if type(block) is not int or not NULL_BLOCK < block < limit:
                _check_id(pool, block)
            count = refs[block]
            if count == 1:
                refs[block] = 0
                num_free += 1
                if hash_of[block] is not None:
                    if tail == NULL_BLOCK:
                        log += (REFS, block, 1)
                        head = block
                    else:
                        log += (REFS, block, 1, NXT, tail, NULL_BLOCK, PRV, block, NULL_BLOCK)
                        nxt[tail] = block
                        prv[block] = tail
                    tail = block
                    continue
                after = head if front == NULL_BLOCK else nxt[front]
                log += (REFS, block, 1)
                if front == NULL_BLOCK:
                    head = block
                else:
                    log += (NXT, front, after, PRV, block, NULL_BLOCK)
                    nxt[front] = block
                    prv[block] = front
                if after == NULL_BLOCK:
                    tail = block
                else:
                    log += (PRV, after, front, NXT, block, NULL_BLOCK)
                    prv[after] = block
                    nxt[block] = after
                if fresh_left and split == front:
                    split = block
                front = block
            elif count:
                log += (REFS, block, count)
                refs[block] = count - 1
            else:
                raise BlockPoolError(
                    f"release: block {block} has ref count 0 (double free, or never handed out)"
                )
    except BaseException:
        tx.abort()
        raise
    return _relinked(pool, head, tail, split, num_free, tx.commit())


def set_block_hash(pool: BlockPool, block_id: int, block_hash: BlockHash) -> BlockPool:
    return cache_blocks(pool, (block_id,), (block_hash,))


def cache_blocks(
    pool: BlockPool, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]
) -> BlockPool:
    """Register full, held blocks under their hashes (a batched `set_block_hash`)."""
    if len(block_ids) != len(block_hashes):
        raise BlockPoolError(
            f"cache_blocks: {len(block_ids)} block ids but {len(block_hashes)} hashes"
        )
    _check_hashes(block_hashes)
    limit = pool.num_blocks
    refs, _, _, hash_of, _, _ = vs.read(pool.data)
    for block in block_ids:
        if type(block) is not int or not NULL_BLOCK < block < limit or not refs[block]:
            _check_id(pool, block)
            raise BlockPoolError(f"set_block_hash: block {block} is free; only held blocks fill")
        if hash_of[block] is not None:
            raise BlockPoolError(f"set_block_hash: block {block} already has a hash")
    if len(set(block_ids)) != len(block_ids):
        raise BlockPoolError(f"cache_blocks: repeated block ids {tuple(block_ids)}")
    tx = vs.Transaction(pool.data)
    _register(tx, block_ids, block_hashes)
    return BlockPool(
        pool.num_blocks,
        pool.block_size,
        pool.next_fresh,
        pool.head,
        pool.tail,
        pool.split,
        pool.num_free,
        pool.num_cached + len(block_hashes),
        tx.commit(),
    )


# ---------------------------------------------------------------- internals


def _relinked(
    pool: BlockPool, head: int, tail: int, split: int, num_free: int, data: vs.Version
) -> BlockPool:
    """`pool` after a transition that moved blocks on or off the free list (`touch`, `release`):
    the fresh range and the hash count are as they were. Positional: once per transition."""
    return BlockPool(
        pool.num_blocks,
        pool.block_size,
        pool.next_fresh,
        head,
        tail,
        split,
        num_free,
        pool.num_cached,
        data,
    )


def _check_hashes(block_hashes: Sequence[BlockHash]) -> None:
    for block_hash in block_hashes:
        if type(block_hash) is not bytes or len(block_hash) != HASH_NBYTES:
            raise BlockPoolError(
                f"block hash {block_hash!r}: expected {HASH_NBYTES} bytes (a sha256 digest)"
            )


def _register(tx: vs.Transaction, blocks: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
    """Give held, unhashed blocks their hashes (zip stops at the shorter of the two)."""
    _, _, _, hash_of, index, dup = tx.tables
    log = tx.log
    absent = vs.ABSENT
    for block, block_hash in zip(blocks, block_hashes, strict=False):
        first = index.get(block_hash)
        if first is None:
            log += (HASH_OF, block, None, INDEX, block_hash, absent)
            hash_of[block] = block_hash
            index[block_hash] = block
            continue
        log += (HASH_OF, block, None)
        hash_of[block] = block_hash
        # Holders stay in registration order (vLLM's per-hash dict): a lookup gets the earliest,
        # and when it is evicted, the next earliest.
        last = first
        while (later := dup.get(last)) is not None:
            last = later
        tx.set(DUP, last, block)


def _drop_shared_hash(tx: vs.Transaction, block: int, block_hash: BlockHash) -> None:
    """Unregister one of several holders of `block_hash` (its own HASH_OF entry is gone)."""
    _, _, _, _, index, dup = tx.tables
    later = dup.get(block)
    if later is not None:
        tx.delete(DUP, block)
    first = index[block_hash]
    if first == block:
        if later is None:
            tx.delete(INDEX, block_hash)
        else:
            tx.set(INDEX, block_hash, later)
        return
    before = first
    while dup[before] != block:
        before = dup[before]
    if later is None:
        tx.delete(DUP, before)
    else:
        tx.set(DUP, before, later)


def _check_id(pool: BlockPool, block_id: object) -> None:
    if not _is_int(block_id) or not NULL_BLOCK < block_id < pool.num_blocks:
        raise BlockPoolError(
            f"block id {block_id!r}: expected an int in 1..{pool.num_blocks - 1} "
            f"(block {NULL_BLOCK} is the reserved null block)"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
