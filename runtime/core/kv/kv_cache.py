"""Per-request block tables over a `BlockPool`: prefix-cache lookup, allocate, free, pins.

Every function is pure: it takes a `KVCache` value and returns a new one (or a query result).
Misuse raises `KVCacheError` (or `BlockPoolError` for bad block ids) and leaves the input valid.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from immutables import Map

from runtime.core.kv import block_pool as bp
from runtime.core.kv.block_hash import HashExtras, extend_block_hashes
from runtime.core.kv.block_pool import BlockHash, BlockPool
from runtime.core.kv.kv_invariants import check_invariants

__all__ = [
    "Allocated",
    "CachedPrefix",
    "CannotAllocate",
    "HashExtras",
    "KVCache",
    "KVCacheError",
    "allocate_slots",
    "blocks_of",
    "check_invariants",
    "extend_block_hashes",
    "find_cached_prefix",
    "free",
    "has_request",
    "make_kv_cache",
    "num_free_blocks",
    "pin",
    "unpin",
]


class KVCacheError(ValueError):
    """Misuse of the KV cache; the state passed in is left as it was."""


@dataclass(frozen=True, slots=True)
class KVCache:
    pool: BlockPool
    # request id -> its block ids, in token order.
    tables: Map
    # request id -> how many leading blocks of its table are registered in the hash index.
    num_cached: Map
    enable_prefix_caching: bool
    max_model_len: int


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Allocated:
    state: KVCache
    # Blocks freshly taken by this call and appended to the table (not the touched cached ones).
    new_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CannotAllocate:
    blocks_needed: int
    blocks_free: int


class HashedRequest(Protocol):
    @property
    def block_hashes(self) -> tuple[BlockHash, ...]: ...

    @property
    def num_tokens(self) -> int: ...


NO_PREFIX = CachedPrefix(blocks=(), num_tokens=0)


def make_kv_cache(
    num_blocks: int, block_size: int, *, max_model_len: int, enable_prefix_caching: bool = True
) -> KVCache:
    if not _is_count(max_model_len) or max_model_len < 1:
        raise KVCacheError(f"max_model_len={max_model_len!r}: expected an int >= 1")
    if not isinstance(enable_prefix_caching, bool):
        raise KVCacheError(f"enable_prefix_caching={enable_prefix_caching!r}: expected a bool")
    return KVCache(
        pool=bp.make_block_pool(num_blocks, block_size),
        tables=Map(),
        num_cached=Map(),
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
    )


# ---------------------------------------------------------------- queries


def blocks_of(state: KVCache, request_id: str) -> tuple[int, ...]:
    table = state.tables.get(request_id)
    if table is None:
        raise KVCacheError(f"unknown request {request_id!r}: it holds no block table")
    return table


def has_request(state: KVCache, request_id: str) -> bool:
    return request_id in state.tables


def num_free_blocks(state: KVCache) -> int:
    return state.pool.num_free


def find_cached_prefix(state: KVCache, request: HashedRequest) -> CachedPrefix:
    """The longest cached run of the request's hash chain, leaving at least one token to compute."""
    num_tokens = request.num_tokens
    if not _is_count(num_tokens):
        raise KVCacheError(f"request num_tokens={num_tokens!r}: expected an int >= 0")
    if not state.enable_prefix_caching or num_tokens < 1:
        return NO_PREFIX
    hits = bp.cached_run(
        state.pool, request.block_hashes, (num_tokens - 1) // state.pool.block_size
    )
    if not hits:
        return NO_PREFIX
    return CachedPrefix(blocks=hits, num_tokens=len(hits) * state.pool.block_size)


# ---------------------------------------------------------------- transitions


def allocate_slots(
    state: KVCache,
    request_id: str,
    num_new_tokens: int,
    num_computed_tokens: int,
    cached_blocks: Sequence[int] = (),
    lookahead: int = 0,
    *,
    block_hashes: Sequence[BlockHash] = (),
) -> Allocated | CannotAllocate:
    """Ensure slots for `computed | cached | new | lookahead` tokens; cache newly full blocks."""
    for name, value in (
        ("num_new_tokens", num_new_tokens),
        ("num_computed_tokens", num_computed_tokens),
        ("lookahead", lookahead),
    ):
        if not _is_count(value):
            raise KVCacheError(f"allocate_slots({request_id!r}): {name}={value!r}, expected >= 0")
    pool = state.pool
    block_size = pool.block_size
    table = state.tables.get(request_id)
    cached_blocks = tuple(cached_blocks)
    if cached_blocks:
        _check_cached_blocks(state, request_id, table, cached_blocks, block_hashes)
        table = cached_blocks
    elif table is None:
        table = ()
    cached_tokens = len(cached_blocks) * block_size
    filled = num_computed_tokens + cached_tokens + num_new_tokens
    if filled > state.max_model_len:
        raise KVCacheError(
            f"allocate_slots({request_id!r}): {num_computed_tokens} computed + {cached_tokens} "
            f"cached + {num_new_tokens} new tokens = {filled} exceeds "
            f"max_model_len={state.max_model_len}"
        )
    if num_computed_tokens + cached_tokens > len(table) * block_size:
        raise KVCacheError(
            f"allocate_slots({request_id!r}): num_computed_tokens={num_computed_tokens} (+ "
            f"{cached_tokens} cached) but the request holds only {len(table)} blocks of "
            f"{block_size} tokens (stale computed count after a free or preemption?)"
        )
    # Lookahead slots are capped at max_model_len rather than rejected, as vLLM does.
    slots = min(filled + lookahead, state.max_model_len)
    num_new_blocks = max(0, -(-slots // block_size) - len(table))
    num_revived = sum(1 for block in cached_blocks if bp.is_free(pool, block))
    if num_new_blocks + num_revived > pool.num_free:
        return CannotAllocate(blocks_needed=num_new_blocks + num_revived, blocks_free=pool.num_free)

    if cached_blocks:
        pool = bp.touch(pool, cached_blocks)
    num_cached = len(cached_blocks) if cached_blocks else state.num_cached.get(request_id, 0)
    num_full = num_cached
    if state.enable_prefix_caching and block_hashes:
        num_full = max(num_cached, min(filled // block_size, len(block_hashes)))
    # Full blocks already held are registered here (num_cached <= len(table) always); full new
    # ones as they are taken.
    num_held = len(table)
    upto = min(num_full, num_held)
    if upto > num_cached:
        pool = bp.cache_blocks(pool, table[num_cached:upto], block_hashes[num_cached:upto])
    pool, new_blocks = bp.take_free_blocks(pool, num_new_blocks, block_hashes[num_held:num_full])
    if new_blocks:
        table = table + new_blocks
    num_cached = num_full
    tables, cached_counts = state.tables, state.num_cached
    if tables.get(request_id) is not table:
        tables = tables.set(request_id, table)
    if cached_counts.get(request_id) != num_cached:
        cached_counts = cached_counts.set(request_id, num_cached)
    return Allocated(
        state=_evolve(state, pool, tables, cached_counts),
        new_block_ids=new_blocks,
    )


def free(state: KVCache, request_id: str) -> KVCache:
    """Drop the request's references tail-first (its shared prefix is evicted last) and its table."""
    table = blocks_of(state, request_id)
    return _evolve(
        state,
        bp.release(state.pool, reversed(table)),
        state.tables.delete(request_id),
        state.num_cached.delete(request_id),
    )


def pin(state: KVCache, block_ids: Sequence[int]) -> KVCache:
    """References held by other owners (KV store / load jobs); a free cached block is revived."""
    return _evolve(state, bp.touch(state.pool, block_ids), state.tables, state.num_cached)


def unpin(state: KVCache, block_ids: Sequence[int]) -> KVCache:
    """Release pins in the order given (pass tail-first so shared prefixes are evicted last)."""
    return _evolve(state, bp.release(state.pool, block_ids), state.tables, state.num_cached)


# ---------------------------------------------------------------- internals


def _check_cached_blocks(
    state: KVCache,
    request_id: str,
    table: tuple[int, ...] | None,
    cached_blocks: tuple[int, ...],
    block_hashes: Sequence[BlockHash],
) -> None:
    if not state.enable_prefix_caching:
        raise KVCacheError(
            f"allocate_slots({request_id!r}): cached blocks given but prefix caching is off"
        )
    if table:
        raise KVCacheError(
            f"allocate_slots({request_id!r}): cached blocks {cached_blocks} given but the "
            f"request already holds blocks {table}; a prefix hit only applies on admission"
        )
    if len(set(cached_blocks)) != len(cached_blocks):
        raise KVCacheError(
            f"allocate_slots({request_id!r}): repeated cached blocks {cached_blocks}"
        )
    for position, block in enumerate(cached_blocks):
        block_hash = bp.block_hash_of(state.pool, block)
        if block_hash is None:
            raise KVCacheError(
                f"allocate_slots({request_id!r}): cached block {block} holds no cached prefix "
                "(evicted since the lookup?)"
            )
        if position < len(block_hashes) and block_hashes[position] != block_hash:
            raise KVCacheError(
                f"allocate_slots({request_id!r}): cached block {block} holds hash "
                f"{block_hash.hex()[:16]}.. but the request's block {position} is "
                f"{bytes(block_hashes[position]).hex()[:16]}.."
            )


def _evolve(state: KVCache, pool: BlockPool, tables: Map, num_cached: Map) -> KVCache:
    # Positional construction: dataclasses.replace costs several microseconds per call.
    return KVCache(pool, tables, num_cached, state.enable_prefix_caching, state.max_model_len)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
