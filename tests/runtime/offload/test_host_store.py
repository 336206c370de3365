"""HostStore: put/get/exists/remove, LRU eviction, upserts, and the /dev/shm capacity check."""

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from runtime.offload.host_store import HostStore, HostStoreCapacityError

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def value(i: int) -> bytes:
    return bytes([i % 251]) * (BLOCK - 8) + i.to_bytes(8, "little")


def test_put_get_exists_remove_and_lru_eviction(tmp_path):
    with HostStore(4 * BLOCK + 100, BLOCK, shm_dir=str(tmp_path)) as store:
        assert store.num_slots == 4 and store.region_bytes == 4 * BLOCK
        assert os.listdir(tmp_path) == []  # unlinked once mapped: nothing to leak on a crash
        assert (
            store.put([key(i) for i in range(3)], [value(i) for i in range(3)]).stored
            == (True,) * 3
        )
        assert store.exists([key(0), key(1), key(2), key(3)]) == (True, True, True, False)
        assert store.get([key(1), key(7)]) == (value(1), None)
        # key(0) is now the least recently used (key(1) was just read).
        result = store.put([key(3), key(4)], [value(3), value(4)])
        assert result.stored == (True, True) and result.evicted == (key(0),)
        assert store.get([key(i) for i in range(5)]) == (None,) + tuple(
            value(i) for i in (1, 2, 3, 4)
        )
        # Re-store replaces the value (upsert) without evicting anything.
        assert store.put([key(2)], [value(9)]).evicted == ()
        assert store.get([key(2)]) == (value(9),)
        assert store.remove([key(2), key(0)]) == 1 and len(store) == 3
        assert store.put([key(5)], [value(5)]).evicted == ()


def test_bad_values_and_keys_are_refused(tmp_path):
    with HostStore(2 * BLOCK, BLOCK, shm_dir=str(tmp_path)) as store:
        with pytest.raises(ValueError, match="4095 bytes; this store holds blocks of 4096"):
            store.put([key(0)], [bytes(BLOCK - 1)])
        with pytest.raises(ValueError, match="32-byte block hash"):
            store.get([b"short"])
        with pytest.raises(ValueError, match="3 distinct blocks in one call but the store holds 2"):
            store.put([key(i) for i in range(3)], [value(i) for i in range(3)])
        assert len(store) == 0
    with pytest.raises(ValueError, match="raise kv_offload_bytes to at least 4096"):
        HostStore(BLOCK - 1, BLOCK, shm_dir=str(tmp_path))


def test_capacity_check_names_bytes_and_setting_and_leaves_nothing(tmp_path):
    probed = []

    def tiny(directory: str) -> int:
        probed.append(directory)
        return 3 * BLOCK

    with pytest.raises(HostStoreCapacityError) as info:
        HostStore(4 * BLOCK, BLOCK, shm_dir=str(tmp_path), free_bytes=tiny)
    message = str(info.value)
    assert "16384 bytes" in message and "12288 bytes" in message
    assert "kv_offload_bytes" in message and "--shm-size" in message
    assert probed == [str(tmp_path)]
    assert os.listdir(tmp_path) == []


def test_capacity_check_against_a_real_small_tmpfs():
    """A 1 MiB tmpfs on /dev/shm in a private mount namespace refuses a 4 MiB store."""
    script = textwrap.dedent(
        """
        import os
        from runtime.offload.host_store import HostStore, HostStoreCapacityError
        try:
            HostStore(4 << 20, 64 << 10)
        except HostStoreCapacityError as err:
            print("REFUSED", err)
        print("LEFT", os.listdir("/dev/shm"))
        with HostStore(512 << 10, 64 << 10) as store:
            print("FITS", store.num_slots)
        """
    )
    shell = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c '{script}'"
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED insufficient space in /dev/shm" in done.stdout
    assert "4194304 bytes (4.0 MiB) required, 1048576 bytes (1.0 MiB) free" in done.stdout
    assert "LEFT []" in done.stdout and "FITS 8" in done.stdout
