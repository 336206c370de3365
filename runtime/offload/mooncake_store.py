"""MooncakeStore: a client of a Mooncake distributed store (P2PHANDSHAKE metadata, TCP transfers).

Facts this relies on (mooncake-transfer-engine-non-cuda 0.3.13): `put` keeps an existing value,
so re-stores go through `upsert_batch`; a missing key reads back as b''; -200 (no space, eviction
is asynchronous) and -800 (transfer failed) are transient, so writes are retried with backoff and
then reported as not stored, never dropped silently.
"""

import threading
import time
from collections.abc import Callable, Sequence

from runtime.core.kv.block_pool import BlockHash
from runtime.offload.store import KVStore, PutResult, StoreError, check_keys, check_values

__all__ = ["MooncakeStore", "TRANSIENT_ERRORS"]

NO_AVAILABLE_HANDLE = -200
TRANSFER_FAIL = -800
TRANSIENT_ERRORS = frozenset({NO_AVAILABLE_HANDLE, TRANSFER_FAIL})
MIN_SEGMENT_BYTES = 16 << 20


class MooncakeStore(KVStore):
    # A pool other engines write too: the engine looks up each new request's prefix in it.
    shared = True

    def __init__(
        self,
        master: str,
        block_nbytes: int,
        *,
        namespace: str,
        segment_bytes: int = 256 << 20,
        buffer_bytes: int = 64 << 20,
        local_hostname: str = "127.0.0.1",
        retries: int = 4,
        backoff_s: float = 0.01,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"mooncake_master={master!r}: expected 'HOST:PORT'")
        if isinstance(block_nbytes, bool) or not isinstance(block_nbytes, int) or block_nbytes < 1:
            raise ValueError(f"block_nbytes={block_nbytes!r}: expected a positive int")
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"kv_offload_bytes={segment_bytes}: a Mooncake client contributes a segment of "
                f"at least {MIN_SEGMENT_BYTES} bytes (16 MiB) to the pool; raise kv_offload_bytes"
            )
        if block_nbytes > buffer_bytes:
            raise ValueError(
                f"a KV block of {block_nbytes} bytes does not fit the Mooncake staging buffer of "
                f"{buffer_bytes} bytes; raise buffer_bytes"
            )
        from mooncake.store import MooncakeDistributedStore

        self.block_nbytes = block_nbytes
        self._prefix = f"vlax/{namespace}/"
        # Batches are split so one call's bytes fit half the staging buffer.
        self._batch = max(1, buffer_bytes // (2 * block_nbytes))
        self._retries, self._backoff_s, self._sleep = retries, backoff_s, sleep
        self._lock = threading.Lock()
        self._client = MooncakeDistributedStore()
        rc = self._client.setup(
            local_hostname, "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master
        )
        if rc != 0:
            raise StoreError(
                f"Mooncake store setup against mooncake_master={master!r} failed with {rc}; "
                "is mooncake_master running there?"
            )
        self._closed = False

    def exists(self, keys: Sequence[BlockHash]) -> tuple[bool, ...]:
        names = self._names(keys)
        if not names:
            return ()
        with self._lock:
            flags = self._client.batch_is_exist(names)
        failed = [flag for flag in flags if flag < 0]
        if failed:
            # e.g. -900 RPC_FAIL with the master down: unknown, not "absent".
            raise StoreError(
                f"Mooncake batch_is_exist of {len(names)} keys failed with {failed[0]}"
            )
        return tuple(flag == 1 for flag in flags)

    def put(self, keys: Sequence[BlockHash], values: Sequence[bytes | memoryview]) -> PutResult:
        names = self._names(keys)
        views = check_values(tuple(keys), values, self.block_nbytes)
        stored: list[bool] = []
        for start in range(0, len(names), self._batch):
            chunk = slice(start, start + self._batch)
            stored.extend(self._put_chunk(names[chunk], [bytes(v) for v in views[chunk]]))
        return PutResult(stored=tuple(stored))

    def get(self, keys: Sequence[BlockHash]) -> tuple[bytes | None, ...]:
        names = self._names(keys)
        out: list[bytes | None] = []
        for start in range(0, len(names), self._batch):
            with self._lock:
                values = self._client.get_batch(names[start : start + self._batch])
            out.extend(v if len(v) == self.block_nbytes else None for v in values)
        return tuple(out)

    def remove(self, keys: Sequence[BlockHash]) -> int:
        names = self._names(keys)
        if not names:
            return 0
        # force=True: objects are leased for a while after every access (-706 otherwise).
        with self._lock:
            codes = self._client.batch_remove(names, True)
        return sum(1 for code in codes if code == 0)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._client.close()

    def _put_chunk(self, names: list[str], values: list[bytes]) -> list[bool]:
        """upsert_batch, retrying transient failures key by key; True where the value landed."""
        with self._lock:
            rc = self._client.upsert_batch(names, values)
        if rc == 0:
            return [True] * len(names)
        if rc not in TRANSIENT_ERRORS and rc < 0:
            raise StoreError(f"Mooncake upsert_batch of {len(names)} blocks failed with {rc}")
        # The batch is not atomic; retry each key until it lands or the retries run out.
        stored = []
        for name, value in zip(names, values, strict=True):
            rc = self._upsert_with_backoff(name, value)
            if rc not in TRANSIENT_ERRORS and rc != 0:
                raise StoreError(f"Mooncake upsert of {name!r} failed with {rc}")
            stored.append(rc == 0)
        return stored

    def _upsert_with_backoff(self, name: str, value: bytes) -> int:
        delay = self._backoff_s
        rc = self._upsert(name, value)
        for _ in range(self._retries):
            if rc not in TRANSIENT_ERRORS:
                break
            self._sleep(delay)
            delay *= 2
            rc = self._upsert(name, value)
        return rc

    def _upsert(self, name: str, value: bytes) -> int:
        with self._lock:
            return self._client.upsert(name, value)

    def _names(self, keys: Sequence[BlockHash]) -> list[str]:
        if self._closed:
            raise StoreError("MooncakeStore is closed")
        return [self._prefix + key.hex() for key in check_keys(keys)]
