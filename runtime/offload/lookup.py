"""Prefix lookups in a shared store, on their own thread, so a slow store never stalls the engine.

A shared store (other engines write it) may hold more of a new request's prefix than this engine
stored. Asking it is a network round trip; with a Mooncake master down, each call blocks about
4 s before it fails. So the engine holds a new request back, asks on this thread, and hands the
request to the scheduler when the answer (or the failure, counted as "nothing found") is back:
other requests keep running meanwhile, and no request is scheduled without its answer. A failed
lookup answers the ones queued behind it at once, so a dead store costs each request one failure.
"""

import queue
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from runtime.core.kv.block_pool import BlockHash
from runtime.offload.store import KVStore
from runtime.offload.store_thread import StoreThread

__all__ = ["LookupDone", "PrefixLookups", "stored_prefix"]


def stored_prefix(store: KVStore, block_hashes: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
    """The leading run of block_hashes the store holds (raises what the store raises)."""
    if not block_hashes:
        return ()
    flags = tuple(store.exists(block_hashes))
    run = next((i for i, ok in enumerate(flags) if not ok), len(flags))
    return tuple(block_hashes[: min(run, len(block_hashes))])


@dataclass(frozen=True, slots=True)
class LookupDone:
    token: Hashable  # the caller's name for the lookup, given back as it was
    found: tuple[BlockHash, ...]
    error: str | None = None


class PrefixLookups(StoreThread):
    """`take` gives back LookupDone answers, in submission order."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        super().__init__("vlax-kv-lookup")

    def submit(self, token: Hashable, block_hashes: Sequence[BlockHash]) -> None:
        self._todo.put((token, tuple(block_hashes)))

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            token, block_hashes = item
            try:
                self._done.put(LookupDone(token, stored_prefix(self.store, block_hashes)))
            except Exception as err:  # a store that cannot answer holds nothing we count on
                self._done.put(LookupDone(token, (), error=f"exists: {err!r}"))
                # The store just failed: the lookups queued meanwhile are answered "nothing
                # found" without asking, so requests wait one failure, not one per request
                # ahead of them. Lookups submitted from now on ask again.
                if not self._fail_queued(f"not asked, the store just failed: {err!r}"):
                    return

    def _fail_queued(self, error: str) -> bool:
        """Answer every queued lookup with `error`; False if the close sentinel was among them."""
        while True:
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            self._done.put(LookupDone(item[0], (), error=error))
