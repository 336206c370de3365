"""Cache of multimodal encoder outputs, keyed by content hash and shared across requests.

Sizes are in encoder embeddings. Every reference is one (request id, index into its mm_inputs)
pair, so an item repeated in one request stays referenced until its last occurrence is released.
Referenced entries are never evicted; unreferenced ones stay cached ("freeable", LRU order) until
an allocation needs their space.

The runner learns what to compute and what to delete only from `end_step`, which reads the final
state of a scheduling step: an entry evicted and re-allocated in the same step is not freed, and
an entry allocated this step whose only users were preempted in the same step is dropped without
ever reaching the runner.
"""

from collections.abc import Iterable
from dataclasses import dataclass, replace

from immutables import Map

__all__ = [
    "EncoderCache",
    "EncoderCacheError",
    "EncoderEntry",
    "add_ref",
    "allocate",
    "can_allocate",
    "check_invariants",
    "end_step",
    "is_cached",
    "make_encoder_cache",
    "release",
]

Owner = tuple[str, int]


class EncoderCacheError(ValueError):
    """Misuse of the encoder cache; the state passed in is left as it was."""


@dataclass(frozen=True, slots=True)
class EncoderEntry:
    num_embeds: int
    refs: frozenset[Owner]


@dataclass(frozen=True, slots=True)
class EncoderCache:
    capacity: int
    # content hash -> entry, referenced or freeable.
    entries: Map
    # Unreferenced entries, eviction order (head first). A tuple: the cache holds few entries
    # (capacity / embeddings per item), so O(entries) removal is cheaper than a linked map.
    freeable: tuple[str, ...]
    # Embeddings held by no entry, and embeddings held by freeable entries.
    num_free: int
    num_freeable: int
    # Since the last end_step: entries the runner holds that were evicted (in eviction order),
    # and entries allocated (the runner has not computed them yet).
    evicted: tuple[str, ...]
    fresh: frozenset[str]


def make_encoder_cache(capacity: int) -> EncoderCache:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise EncoderCacheError(f"encoder cache capacity={capacity!r}: expected an int >= 0")
    return EncoderCache(
        capacity=capacity,
        entries=Map(),
        freeable=(),
        num_free=capacity,
        num_freeable=0,
        evicted=(),
        fresh=frozenset(),
    )


def is_cached(cache: EncoderCache, content_hash: str) -> bool:
    return content_hash in cache.entries


def can_allocate(cache: EncoderCache, num_embeds: int) -> bool:
    """Whether `num_embeds` fit after evicting freeable entries if needed."""
    return num_embeds <= cache.num_free + cache.num_freeable


def add_ref(cache: EncoderCache, content_hash: str, owner: Owner) -> EncoderCache:
    """A cache hit: `owner` now uses the cached entry (a freeable one stops being freeable)."""
    entry = cache.entries.get(content_hash)
    if entry is None:
        raise EncoderCacheError(f"add_ref: {content_hash!r} is not cached")
    if owner in entry.refs:
        raise EncoderCacheError(f"add_ref: {owner} already references {content_hash!r}")
    freeable, num_freeable = cache.freeable, cache.num_freeable
    if not entry.refs:
        freeable = tuple(h for h in freeable if h != content_hash)
        num_freeable -= entry.num_embeds
    return replace(
        cache,
        entries=cache.entries.set(
            content_hash, EncoderEntry(entry.num_embeds, entry.refs | {owner})
        ),
        freeable=freeable,
        num_freeable=num_freeable,
    )


def allocate(cache: EncoderCache, content_hash: str, owner: Owner, num_embeds: int) -> EncoderCache:
    """Make room (evicting freeable entries, LRU first) and add an entry referenced by `owner`."""
    if isinstance(num_embeds, bool) or not isinstance(num_embeds, int) or num_embeds < 1:
        raise EncoderCacheError(
            f"allocate({content_hash!r}): num_embeds={num_embeds!r}, expected >= 1"
        )
    if content_hash in cache.entries:
        raise EncoderCacheError(f"allocate: {content_hash!r} is already cached; use add_ref")
    if not can_allocate(cache, num_embeds):
        raise EncoderCacheError(
            f"allocate({content_hash!r}): {num_embeds} embeddings needed but only "
            f"{cache.num_free} free + {cache.num_freeable} freeable of {cache.capacity}"
        )
    entries, freeable = cache.entries, cache.freeable
    num_free, num_freeable = cache.num_free, cache.num_freeable
    evicted, fresh = cache.evicted, cache.fresh
    num_evicted = 0
    while num_free < num_embeds:
        victim = freeable[num_evicted]
        num_evicted += 1
        size = entries[victim].num_embeds
        entries = entries.delete(victim)
        num_free += size
        num_freeable -= size
        if victim in fresh:
            fresh = fresh - {victim}
        elif victim not in evicted:
            evicted = evicted + (victim,)
    return replace(
        cache,
        entries=entries.set(content_hash, EncoderEntry(num_embeds, frozenset((owner,)))),
        freeable=freeable[num_evicted:],
        num_free=num_free - num_embeds,
        num_freeable=num_freeable,
        evicted=evicted,
        fresh=fresh | {content_hash},
    )


def release(cache: EncoderCache, owners: Iterable[tuple[str, Owner]]) -> EncoderCache:
    """Drop the given (content hash, owner) references; unreferenced entries become freeable
    (most recently used last)."""
    entries, freeable, num_freeable = cache.entries, list(cache.freeable), cache.num_freeable
    with entries.mutate() as mutable:
        for content_hash, owner in owners:
            entry = mutable.get(content_hash)
            if entry is None or owner not in entry.refs:
                raise EncoderCacheError(f"release: {owner} holds no reference to {content_hash!r}")
            refs = entry.refs - {owner}
            mutable[content_hash] = EncoderEntry(entry.num_embeds, refs)
            if not refs:
                freeable.append(content_hash)
                num_freeable += entry.num_embeds
        entries = mutable.finish()
    return replace(cache, entries=entries, freeable=tuple(freeable), num_freeable=num_freeable)


def end_step(cache: EncoderCache) -> tuple[EncoderCache, tuple[str, ...], tuple[str, ...]]:
    """Close a scheduling step: `(cache, to_compute, to_free)` from its final state.

    to_compute: entries allocated this step and still referenced (the runner computes them now);
    to_free: entries the runner holds that are no longer cached. Entries allocated this step that
    lost every reference (their users were preempted in the same step) are dropped.
    """
    entries, freeable = cache.entries, cache.freeable
    num_free, num_freeable = cache.num_free, cache.num_freeable
    to_compute = []
    for content_hash in sorted(cache.fresh):
        entry = entries[content_hash]
        if entry.refs:
            to_compute.append(content_hash)
            continue
        entries = entries.delete(content_hash)
        freeable = tuple(h for h in freeable if h != content_hash)
        num_free += entry.num_embeds
        num_freeable -= entry.num_embeds
    to_free = tuple(h for h in cache.evicted if h not in entries)
    new_cache = replace(
        cache,
        entries=entries,
        freeable=freeable,
        num_free=num_free,
        num_freeable=num_freeable,
        evicted=(),
        fresh=frozenset(),
    )
    return new_cache, tuple(to_compute), to_free


def check_invariants(cache: EncoderCache) -> None:
    """Raise AssertionError on an inconsistent cache. O(entries); for tests and notebooks."""
    held = sum(e.num_embeds for e in cache.entries.values())
    if held + cache.num_free != cache.capacity or cache.num_free < 0:
        raise AssertionError(f"{held} held + {cache.num_free} free != capacity {cache.capacity}")
    unreferenced = [h for h, e in cache.entries.items() if not e.refs]
    if sorted(unreferenced) != sorted(cache.freeable) or len(set(cache.freeable)) != len(
        cache.freeable
    ):
        raise AssertionError(f"freeable {cache.freeable} but unreferenced {unreferenced}")
    if sum(cache.entries[h].num_embeds for h in cache.freeable) != cache.num_freeable:
        raise AssertionError(f"num_freeable={cache.num_freeable} disagrees with {cache.freeable}")
    if not cache.fresh <= set(cache.entries):
        raise AssertionError(f"fresh {sorted(cache.fresh)} not all cached")
