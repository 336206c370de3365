"""FaultyStore: a real HostStore behind seeded faults, each of a kind the KVStore contract allows."""

import hashlib

import pytest

from runtime.offload.fault_injection import FaultyStore
from runtime.offload.host_store import HostStore
from runtime.offload.store import StoreError, check_store

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(b"fault block %d" % i).digest()


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (BLOCK // 4)


def calls(store: FaultyStore, rounds: int = 60) -> list:
    """A fixed sequence of puts and gets; what each answered (or the error's message)."""
    seen = []
    for i in range(rounds):
        keys = [key(i), key(i + 1)]
        try:
            seen.append(store.put(keys, [value(i), value(i + 1)]).stored)
        except StoreError as err:
            seen.append(str(err))
        try:
            seen.append(store.get(keys))
        except StoreError as err:
            seen.append(str(err))
    return seen


def test_no_faults_is_the_wrapped_store(tmp_path):
    with HostStore(64 * BLOCK, BLOCK, shm_dir=str(tmp_path)) as host:
        store = check_store(
            FaultyStore(host, read_fault_rate=0, write_fault_rate=0, close_inner=False)
        )
        assert store.block_nbytes == BLOCK and store.shared is False
        assert store.put([key(0)], [value(0)]).stored == (True,)
        assert store.get([key(0), key(1)]) == (value(0), None)
        assert store.exists([key(0)]) == (True,) and store.remove([key(0)]) == 1
        assert store.num_injected == 0 and store.calls == {"put": 1, "get": 1, "exists": 1}
        store.close()
        assert host.get([key(0)]) == (None,)  # close_inner=False: the host store is still open


def test_every_fault_kind_and_the_same_faults_for_the_same_seed(tmp_path):
    runs = []
    for seed in (3, 3, 4):
        host = HostStore(256 * BLOCK, BLOCK, shm_dir=str(tmp_path))
        with FaultyStore(host, read_fault_rate=0.5, write_fault_rate=0.5, seed=seed) as store:
            runs.append((calls(store), dict(store.injected)))
    (first, injected), (again, injected_again), (other, _) = runs
    assert first == again and injected == injected_again
    assert first != other
    assert set(injected) == {
        ("put", "raise"),
        ("put", "partial"),
        ("get", "raise"),
        ("get", "lost"),
        ("get", "not finite"),
    }
    assert 0.3 < sum(injected.values()) / 120 < 0.7
    # A partial put stores the leading half and says so; a torn read is all 0xFF (NaN).
    assert (True, False) in first and (False, False) not in first
    assert any(isinstance(r, tuple) and r and r[-1] == b"\xff" * BLOCK for r in first)


def test_every_read_fails_when_the_rate_is_one(tmp_path):
    with HostStore(8 * BLOCK, BLOCK, shm_dir=str(tmp_path)) as host:
        store = FaultyStore(host, read_fault_rate=1.0, write_fault_rate=0.0, seed=0)
        host.put([key(i) for i in range(8)], [value(i) for i in range(8)])
        with pytest.raises(StoreError, match="injected fault: exists of 1 blocks"):
            store.exists([key(0)])
        outcomes = []
        for i in range(8):
            try:
                (got,) = store.get([key(i)])
            except StoreError:
                outcomes.append("raise")
                continue
            if got is None:  # lost: gone from the wrapped store too
                assert host.exists([key(i)]) == (False,)
                outcomes.append("lost")
            else:
                assert got == b"\xff" * BLOCK and host.get([key(i)]) == (value(i),)
                outcomes.append("not finite")
        assert {("get", kind): outcomes.count(kind) for kind in set(outcomes)} == {
            k: n for k, n in store.injected.items() if k[0] == "get"
        }
        assert len(set(outcomes)) > 1


def test_rates_are_checked(tmp_path):
    with HostStore(BLOCK, BLOCK, shm_dir=str(tmp_path)) as host:
        with pytest.raises(
            ValueError, match=r"read_fault_rate=1.5: expected a fraction in \[0, 1\]"
        ):
            FaultyStore(host, read_fault_rate=1.5, write_fault_rate=0)
        with pytest.raises(TypeError, match="no method get"):
            FaultyStore(object(), read_fault_rate=0, write_fault_rate=0)
