"""The KV store protocol: what an object must do to hold the engine's offloaded KV blocks.

`LLM(kv_offload=...)` (and `EngineConfig.kv_offload`) takes "host" or "mooncake", which build one
of the stores below, or any object that implements `KVStore`: the embedded `HostStore`
(runtime/offload/host_store.py), the `MooncakeStore` client (runtime/offload/mooncake_store.py),
or a wrapper of either (runtime/offload/fault_injection.py fails a seeded fraction of calls).
`check_store` is the gate: it names every member an object lacks.

Keys are block hashes (`runtime.core.kv.block_pool.BlockHash`, 32 bytes): each chains its parent's
hash, so a key names a block's content together with its whole prefix, and two engines that
compute the same prefix agree on the keys. Keys do not name the model: a store shared by engines of
different models (or KV dtypes, or block sizes) must keep them apart itself (MooncakeStore's
`namespace`). Values are one block's bytes, its slice of every array of every cache pool (device_copy.py),
exactly `block_nbytes` of them.
"""

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.core.kv.block_pool import HASH_NBYTES, BlockHash

__all__ = [
    "KVStore",
    "PutResult",
    "StoreError",
    "check_keys",
    "check_store",
    "check_values",
]


class StoreError(RuntimeError):
    """A store could not be created, reached or used; the message names what to change."""


@dataclass(frozen=True, slots=True)
class PutResult:
    # One flag per key given: True when the value is in the store after the call.
    stored: tuple[bool, ...]
    # Keys this call evicted to make room (reported so the planner stops counting on them).
    evicted: tuple[BlockHash, ...] = ()


class KVStore(Protocol):
    """A content-addressed store of whole KV blocks: the contract between the engine and a store.

    Members:
      block_nbytes: int. The size of every value. The engine checks at start that it equals its
        own KV block size (model, KV dtype and block_size decide it) and refuses the store
        otherwise, naming both numbers.
      shared: bool. True when other engines (processes) may write the store too; the engine then
        asks `exists` about each new request's prefix, to load what others stored.
      exists(keys) -> tuple[bool, ...]: one flag per key, True when `get` would find it now.
      put(keys, values) -> PutResult: store each value under its key; a re-store of a held key
        replaces its value (upsert). `PutResult.stored[i]` is True only if value i is in the
        store when the call returns; False (no space, a transient failure) is not an error.
        `evicted` lists keys the call pushed out, if the store knows.
      get(keys) -> tuple[bytes | None, ...]: each key's value (bytes or any buffer of
        `block_nbytes` bytes), or None where the store does not hold it. A value must be the
        bytes put under that key, unchanged: the engine checks only that they are finite.
      remove(keys) -> int: drop the keys; returns how many were held.
      close() -> None: release the store's resources; idempotent. Calls after it may raise.

    Arguments: `keys` is a sequence of 32-byte block hashes (`check_keys` validates them), with
    one value per key for `put` (each of `block_nbytes` bytes; `check_values`). The calls are
    batched; an empty sequence is valid and answers empty.

    Failures: a method may raise (any Exception; `StoreError` by convention) when the store is
    unreachable or broken. The engine never lets a store failure reach a request: a failed put
    (raised, or any `stored` flag False) fails that store job, and the blocks are not counted as
    stored; a failed get (raised, or any value None) fails that load job, and the request
    computes those tokens instead; a failed `exists` counts as "nothing found". Every job ends
    exactly once either way, and its blocks are unpinned. So a store may drop, refuse or lose
    anything at any time; what it must never do is hand back other bytes than were put.

    Threads: `put` and `get` run on the engine's offload worker thread, `exists` on the thread
    that adds requests, and `close` on the thread that closes the engine, so an implementation
    must be safe under concurrent calls from two threads. Calls may block (the engine's step
    does not wait for puts and gets), but a call that never returns stalls every later job.

    Lifetime: a store the engine built from "host" or "mooncake" is closed by `Engine.close()`;
    a store object passed in stays its creator's to close (so one store can serve several
    engines in turn), after the engines that use it are closed.

    Implementations may subclass `KVStore` to say so (HostStore, MooncakeStore do, and get
    `with` support); any object with these members is accepted.
    """

    block_nbytes: int
    shared: bool

    @abstractmethod
    def exists(self, keys: Sequence[BlockHash]) -> tuple[bool, ...]: ...

    @abstractmethod
    def put(self, keys: Sequence[BlockHash], values: Sequence[bytes | memoryview]) -> PutResult:
        """Store (or replace: re-stores are upserts) each value under its key."""

    @abstractmethod
    def get(self, keys: Sequence[BlockHash]) -> tuple[bytes | None, ...]:
        """Each key's bytes, or None where the store does not hold it."""

    @abstractmethod
    def remove(self, keys: Sequence[BlockHash]) -> int:
        """Drop the keys; returns how many were held."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_METHODS = ("exists", "put", "get", "remove", "close")


def check_store(store: object, block_nbytes: int | None = None) -> object:
    """Return `store` if it implements `KVStore` (and holds blocks of `block_nbytes` bytes when
    given); else raise TypeError / ValueError naming every member it lacks or gets wrong."""
    name = f"kv_offload={type(store).__name__} object"
    problems = [f"no method {m}()" for m in _METHODS if not callable(getattr(store, m, None))]
    nbytes = getattr(store, "block_nbytes", None)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        problems.append(f"block_nbytes={nbytes!r} is not a positive int")
    shared = getattr(store, "shared", None)
    if not isinstance(shared, bool):
        problems.append(f"shared={shared!r} is not a bool")
    if problems:
        raise TypeError(
            f"{name} does not implement the KV store protocol (runtime/offload/store.py "
            f"KVStore: block_nbytes, shared, {', '.join(_METHODS)}): {'; '.join(problems)}"
        )
    if block_nbytes is not None and nbytes != block_nbytes:
        raise ValueError(
            f"{name} holds blocks of {nbytes} bytes, but this engine's KV blocks are "
            f"{block_nbytes} bytes (model, KV dtype and block_size decide it); create the store "
            f"with block_nbytes={block_nbytes}"
        )
    return store


def check_keys(keys: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
    keys = tuple(keys)
    for key in keys:
        if not isinstance(key, bytes) or len(key) != HASH_NBYTES:
            raise ValueError(f"store key {key!r}: expected a {HASH_NBYTES}-byte block hash")
    return keys


def check_values(
    keys: tuple[BlockHash, ...], values: Sequence[bytes | memoryview], block_nbytes: int
) -> tuple[memoryview, ...]:
    views = tuple(memoryview(value).cast("B") for value in values)
    if len(views) != len(keys):
        raise ValueError(f"put: {len(keys)} keys but {len(views)} values")
    for view in views:
        if view.nbytes != block_nbytes:
            raise ValueError(
                f"put: a value of {view.nbytes} bytes; this store holds blocks of "
                f"{block_nbytes} bytes"
            )
    return views
