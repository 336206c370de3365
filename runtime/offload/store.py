"""The KV store interface: batched exists / put / get / remove of whole KV blocks.

Keys are block hashes (`runtime.core.block_pool.BlockHash`): each chains its parent's hash, so a
key names a block's content together with its whole prefix, and two engines that compute the same
prefix agree on the keys. Values are one block's bytes (every layer's k and v slice of it).
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.core.block_pool import HASH_NBYTES, BlockHash

__all__ = ["KVStore", "PutResult", "StoreError", "check_keys", "check_values"]


class StoreError(RuntimeError):
    """A store could not be created or reached; the message names the setting to change."""


@dataclass(frozen=True, slots=True)
class PutResult:
    # One flag per key given: True when the value is in the store after the call.
    stored: tuple[bool, ...]
    # Keys this call evicted to make room (reported so the planner stops counting on them).
    evicted: tuple[BlockHash, ...] = ()


class KVStore(ABC):
    """A content-addressed block store. Implementations are safe to call from several threads."""

    block_nbytes: int

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

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
