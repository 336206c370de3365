"""PrefixLookups: a shared store's prefix lookups on their own thread, answered in order; a failed
lookup answers the ones queued behind it without asking the store again."""

import hashlib
import threading

from runtime.offload.host_store import HostStore
from runtime.offload.lookup import PrefixLookups
from runtime.offload.store import StoreError

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(b"lookup block %d" % i).digest()


class FlakyPool(HostStore):
    """A real HostStore whose `exists` first waits for `release`, then raises `failures` times."""

    shared = True

    def __init__(self, *args, failures: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.failures = failures
        self.calls = 0

    def exists(self, keys):
        self.calls += 1
        self.entered.set()
        if not self.release.wait(timeout=600):  # a hang guard
            raise AssertionError("never released")
        if self.failures:
            self.failures -= 1
            raise StoreError("master down")
        return super().exists(keys)


def take(lookups, n):
    done = []
    while len(done) < n:
        done.extend(lookups.take(wait_s=600))
    return done


def test_answers_in_order_with_the_leading_stored_run(tmp_path):
    with FlakyPool(16 * BLOCK, BLOCK, shm_dir=str(tmp_path), failures=0) as store:
        store.release.set()
        store.put([key(i) for i in (0, 1, 3)], [bytes(BLOCK)] * 3)
        lookups = PrefixLookups(store)
        try:
            lookups.submit("x", [key(0), key(1), key(2), key(3)])
            lookups.submit("y", [key(5)])
            lookups.submit("z", [])
            done = take(lookups, 3)
        finally:
            lookups.close()
    assert [(d.token, d.found, d.error) for d in done] == [
        ("x", (key(0), key(1)), None),
        ("y", (), None),
        ("z", (), None),
    ]


def test_a_failure_answers_the_queued_lookups_without_asking(tmp_path):
    with FlakyPool(16 * BLOCK, BLOCK, shm_dir=str(tmp_path), failures=1) as store:
        store.put([key(0)], [bytes(BLOCK)])
        lookups = PrefixLookups(store)
        try:
            lookups.submit(1, [key(0)])
            assert store.entered.wait(timeout=600)  # the first lookup is in the store's hands
            for token in (2, 3, 4):
                lookups.submit(token, [key(0)])
            store.release.set()  # it fails; 2, 3, 4 were queued behind it
            first = take(lookups, 4)
            assert store.calls == 1
            lookups.submit(5, [key(0)])  # asked again, and the store answers now
            (last,) = take(lookups, 1)
        finally:
            lookups.close()
    assert [(d.token, d.found) for d in first] == [(t, ()) for t in (1, 2, 3, 4)]
    assert "master down" in first[0].error and first[0].error.startswith("exists:")
    assert all(d.error.startswith("not asked, the store just failed") for d in first[1:])
    assert (last.token, last.found, last.error, store.calls) == (5, (key(0),), None, 2)
