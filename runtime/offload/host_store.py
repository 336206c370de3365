"""HostStore: the embedded KV store, a fixed-size region of host shared memory with LRU eviction.

The region is a file in /dev/shm, created with O_EXCL, checked against the free space of its
filesystem before anything is allocated, reserved whole with posix_fallocate (so a full /dev/shm
fails here, not later as SIGBUS on a write), mapped, and unlinked at once: the mapping keeps the
memory alive, so a process that dies after that leaves nothing behind in /dev/shm.

A process killed inside that window (the reservation of a large region takes a while) leaves its
file. The file's name says whose it is (`shm_segments.py`), and every new HostStore first unlinks
the segments of owners that are gone, logging each one.
"""

import contextlib
import mmap
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from runtime.core.kv.block_pool import BlockHash
from runtime.offload.shm_segments import new_segment_path, reclaim_stale_segments
from runtime.offload.store import KVStore, PutResult, StoreError, check_keys, check_values

__all__ = ["HostStore", "HostStoreCapacityError", "shm_free_bytes"]


class HostStoreCapacityError(StoreError):
    """The host region does not fit in the free space of its shared-memory filesystem."""


def shm_free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free


class HostStore(KVStore):
    """One process's store: nobody else writes it, so the engine never asks it about prefixes
    it did not store itself."""

    shared = False

    def __init__(
        self,
        capacity_bytes: int,
        block_nbytes: int,
        *,
        shm_dir: str = "/dev/shm",
        free_bytes: Callable[[str], int] = shm_free_bytes,
    ) -> None:
        for name, value in (("kv_offload_bytes", capacity_bytes), ("block_nbytes", block_nbytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive int")
        num_slots = capacity_bytes // block_nbytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_bytes={capacity_bytes} holds no KV block of {block_nbytes} bytes; "
                f"raise kv_offload_bytes to at least {block_nbytes}"
            )
        self.block_nbytes = block_nbytes
        self.num_slots = num_slots
        self.region_bytes = num_slots * block_nbytes
        self._map = _create_region(shm_dir, self.region_bytes, capacity_bytes, free_bytes)
        self._lock = threading.Lock()
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU order, oldest first
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slots)

    def exists(self, keys: Sequence[BlockHash]) -> tuple[bool, ...]:
        keys = check_keys(keys)
        with self._lock:
            return tuple(key in self._slots for key in keys)

    def put(self, keys: Sequence[BlockHash], values: Sequence[bytes | memoryview]) -> PutResult:
        keys = check_keys(keys)
        views = check_values(keys, values, self.block_nbytes)
        key_set = set(keys)
        if len(key_set) > self.num_slots:
            raise ValueError(
                f"put: {len(key_set)} distinct blocks in one call but the store holds "
                f"{self.num_slots}; raise kv_offload_bytes or store in smaller batches"
            )
        evicted = []
        self._check_open()
        with self._lock:
            for key, view in zip(keys, views, strict=True):
                slot = self._slots.get(key)
                if slot is None:
                    if not self._free_slots:
                        old_key, old_slot = self._slots.popitem(last=False)
                        evicted.append(old_key)
                        self._free_slots.append(old_slot)
                    slot = self._free_slots.pop()
                    self._slots[key] = slot
                else:
                    self._slots.move_to_end(key)
                start = slot * self.block_nbytes
                self._map[start : start + self.block_nbytes] = view
        # Keys of this call sit at the LRU tail, so only a key evicted and then re-put in this
        # same call can be both evicted and stored; it is stored.
        return PutResult(
            stored=(True,) * len(keys), evicted=tuple(k for k in evicted if k not in key_set)
        )

    def get(self, keys: Sequence[BlockHash]) -> tuple[bytes | None, ...]:
        keys = check_keys(keys)
        self._check_open()
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if slot is None:
                    out.append(None)
                    continue
                self._slots.move_to_end(key)
                start = slot * self.block_nbytes
                out.append(self._map[start : start + self.block_nbytes])
        return tuple(out)

    def remove(self, keys: Sequence[BlockHash]) -> int:
        keys = check_keys(keys)
        removed = 0
        with self._lock:
            for key in keys:
                slot = self._slots.pop(key, None)
                if slot is not None:
                    self._free_slots.append(slot)
                    removed += 1
        return removed

    def close(self) -> None:
        with self._lock:
            if not self._map.closed:
                self._map.close()
            self._slots.clear()

    def _check_open(self) -> None:
        if self._map.closed:
            raise StoreError("HostStore is closed")


def _create_region(
    shm_dir: str, region_bytes: int, capacity_bytes: int, free_bytes: Callable[[str], int]
) -> mmap.mmap:
    reclaim_stale_segments(shm_dir)
    path = new_segment_path(shm_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        raise StoreError(f"cannot create the host KV region {path}: {err}") from err
    try:
        free = free_bytes(shm_dir)
        if region_bytes > free:
            raise _capacity_error(shm_dir, region_bytes, free, capacity_bytes)
        try:
            os.posix_fallocate(fd, 0, region_bytes)
        except OSError as err:
            # The probe raced another writer, or the filesystem reports free space it cannot give.
            raise _capacity_error(
                shm_dir, region_bytes, free_bytes(shm_dir), capacity_bytes
            ) from err
        return mmap.mmap(fd, region_bytes)
    finally:
        os.close(fd)
        # Already gone if a process that could not see us as alive (another pid namespace
        # sharing this /dev/shm) reclaimed it; the mapping does not need the name.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _capacity_error(
    shm_dir: str, required: int, free: int, capacity: int
) -> HostStoreCapacityError:
    return HostStoreCapacityError(
        f"insufficient space in {shm_dir} for the host KV store: {required} bytes "
        f"({required / 2**20:.1f} MiB) required, {free} bytes ({free / 2**20:.1f} MiB) free; "
        f"lower kv_offload_bytes (now {capacity}) or enlarge {shm_dir} "
        f"(docker --shm-size, or --ipc=host)"
    )
