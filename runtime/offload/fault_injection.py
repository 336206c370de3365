"""FaultyStore: a real KV store behind a wrapper that fails a seeded fraction of its calls.

For soaks and chaos tests of the engine's store paths (benchmarks/soak.py): every call goes to the
wrapped store (a HostStore, a MooncakeStore), and a seeded fraction of reads and writes fails in
one of the ways a real store fails, per the KVStore contract (runtime/offload/store.py):
- a write raises (`StoreError`, nothing stored), or stores only some keys and reports the rest as
  not stored (a full pool);
- a read raises, or answers None for some keys it held (evicted behind the engine's back), or
  hands back a value of the right size that is not finite (a torn read: the engine must refuse to
  attend to it);
- `exists` raises (an unreachable pool).
Whether a call fails is a function of the seed, the call's kind, how many calls of that kind came
before it and its first key: the same calls in the same order meet the same faults.
"""

import hashlib
import threading
from collections import Counter
from collections.abc import Sequence

from runtime.core.kv.block_pool import BlockHash
from runtime.offload.store import KVStore, PutResult, StoreError, check_store

__all__ = ["FaultyStore"]

_SCALE = float(1 << 64)


class FaultyStore(KVStore):
    def __init__(
        self,
        inner: KVStore,
        *,
        read_fault_rate: float,
        write_fault_rate: float,
        seed: int = 0,
        close_inner: bool = True,
    ) -> None:
        """`close_inner`: close the wrapped store with this one."""
        check_store(inner)
        for name, rate in (
            ("read_fault_rate", read_fault_rate),
            ("write_fault_rate", write_fault_rate),
        ):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name}={rate!r}: expected a fraction in [0, 1]")
        self.inner = inner
        self.block_nbytes = inner.block_nbytes
        self.shared = inner.shared
        self.read_fault_rate, self.write_fault_rate = read_fault_rate, write_fault_rate
        self.seed, self.close_inner = seed, close_inner
        self._lock = threading.Lock()
        # (operation, fault kind) -> how many were injected; calls per operation.
        self.injected: Counter = Counter()
        self.calls: Counter = Counter()

    @property
    def num_injected(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    def exists(self, keys: Sequence[BlockHash]) -> tuple[bool, ...]:
        if self._draw("exists", keys, self.read_fault_rate) is not None:
            self._count("exists", "raise")
            raise StoreError(f"injected fault: exists of {len(keys)} blocks unreachable")
        return self.inner.exists(keys)

    def put(self, keys: Sequence[BlockHash], values: Sequence[bytes | memoryview]) -> PutResult:
        draw = self._draw("put", keys, self.write_fault_rate)
        if draw is None:
            return self.inner.put(keys, values)
        if draw < 0.5 or len(keys) < 2:
            self._count("put", "raise")
            raise StoreError(f"injected fault: put of {len(keys)} blocks failed")
        # A full pool: the leading half lands, the rest is reported as not stored.
        self._count("put", "partial")
        kept = len(keys) // 2
        result = self.inner.put(keys[:kept], values[:kept])
        return PutResult(
            stored=result.stored + (False,) * (len(keys) - kept), evicted=result.evicted
        )

    def get(self, keys: Sequence[BlockHash]) -> tuple[bytes | None, ...]:
        draw = self._draw("get", keys, self.read_fault_rate)
        if draw is None:
            return self.inner.get(keys)
        if draw < 1 / 3:
            self._count("get", "raise")
            raise StoreError(f"injected fault: get of {len(keys)} blocks failed")
        values = list(self.inner.get(keys))
        if draw < 2 / 3:
            # Evicted behind the engine's back: the last key is gone, from the store too.
            self._count("get", "lost")
            self.inner.remove(keys[-1:])
            values[-1] = None
        elif values[-1] is not None:
            # A torn read: right size, not finite (0xFF bytes are NaN in every float dtype).
            self._count("get", "not finite")
            values[-1] = b"\xff" * self.block_nbytes
        return tuple(values)

    def remove(self, keys: Sequence[BlockHash]) -> int:
        return self.inner.remove(keys)

    def close(self) -> None:
        if self.close_inner:
            self.inner.close()

    def _draw(self, operation: str, keys: Sequence[BlockHash], rate: float) -> float | None:
        """None for a call that goes through; else a uniform [0, 1) number choosing the fault."""
        if not keys:
            return None
        with self._lock:
            index = self.calls[operation]
            self.calls[operation] = index + 1
        digest = hashlib.blake2b(
            b"%d:%s:%d:" % (self.seed, operation.encode(), index) + bytes(keys[0]),
            digest_size=16,
        ).digest()
        fail = int.from_bytes(digest[:8], "little") / _SCALE
        if fail >= rate:
            return None
        return int.from_bytes(digest[8:], "little") / _SCALE

    def _count(self, operation: str, kind: str) -> None:
        with self._lock:
            self.injected[operation, kind] += 1
