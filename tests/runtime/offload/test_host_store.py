"""HostStore: put/get/exists/remove, LRU eviction, upserts, the /dev/shm capacity check, and
no segment left behind by a process killed with SIGKILL (the next store reclaims it, logging)."""

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from runtime.offload.host_store import HostStore, HostStoreCapacityError
from runtime.offload.shm_segments import process_start, reclaim_stale_segments, segment_name

BLOCK = 4096
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


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
        timeout=600,  # a hang guard: a Python start-up on a loaded machine is slow
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED insufficient space in /dev/shm" in done.stdout
    assert "4194304 bytes (4.0 MiB) required, 1048576 bytes (1.0 MiB) free" in done.stdout
    assert "LEFT []" in done.stdout and "FITS 8" in done.stdout


# A child that creates a HostStore in `shm_dir`, reports, then waits to be killed. With
# `in_window`, it stops inside the creation window (after the O_EXCL create, before the unlink):
# the free-space probe is where a large region's reservation would be under way.
CHILD = textwrap.dedent(
    """
    import os, sys
    from runtime.offload.host_store import HostStore
    shm_dir, in_window = sys.argv[1], sys.argv[2] == "1"

    def probe(directory):
        if in_window:
            print("IN WINDOW", os.listdir(directory), flush=True)
            sys.stdin.read()  # until killed
        return 1 << 30

    store = HostStore(4 * 4096, 4096, shm_dir=shm_dir, free_bytes=probe)
    store.put([bytes(32)], [bytes(4096)])
    print("STORE UP", os.listdir(shm_dir), flush=True)
    sys.stdin.read()
    """
)


def kill_child_at(shm_dir, in_window: bool) -> str:
    """Start the child, wait for its report line, SIGKILL it, and return the line."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(shm_dir), "1" if in_window else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = child.stdout.readline()
    finally:
        child.kill()  # SIGKILL: no finally, no atexit, no unlink
        child.wait(timeout=60)
        child.stdin.close()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return line


def test_a_process_killed_with_the_store_up_leaves_no_segment(tmp_path):
    line = kill_child_at(tmp_path, in_window=False)
    assert line == "STORE UP []\n"
    assert os.listdir(tmp_path) == []


def test_a_segment_left_by_a_killed_process_is_reclaimed_with_a_log_line(tmp_path, caplog):
    line = kill_child_at(tmp_path, in_window=True)
    assert line.startswith("IN WINDOW ['vlax-kv-"), line
    (left,) = os.listdir(tmp_path)
    logs = caplog.at_level(logging.WARNING, logger="runtime.offload.shm_segments")
    with logs, HostStore(2 * BLOCK, BLOCK, shm_dir=str(tmp_path)) as store:
        assert os.listdir(tmp_path) == []
        assert store.put([key(0)], [value(0)]).stored == (True,)
    assert os.listdir(tmp_path) == []
    (record,) = caplog.records
    pid = int(left.split("-")[2])
    assert record.getMessage() == (
        f"reclaimed {tmp_path / left} (0 bytes), a host KV store segment left by process {pid}, "
        "which is gone"
    )


def test_segments_of_live_owners_and_foreign_files_are_kept(tmp_path, caplog):
    """A live process's segment (this one's, or one whose pid matches but whose start time shows
    the pid was reused since) is judged by pid and start time; files vlax did not name are left."""
    me = os.getpid()
    mine = tmp_path / segment_name(me, process_start(me))
    reused = tmp_path / segment_name(me, process_start(me) + 1)
    legacy_live = tmp_path / f"vlax-kv-{me}-{'ab' * 8}"
    foreign = tmp_path / "vlax-kv-other-file"
    for path in (mine, reused, legacy_live, foreign):
        path.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="runtime.offload.shm_segments"):
        assert reclaim_stale_segments(str(tmp_path)) == [str(reused)]
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (mine, legacy_live, foreign))
    assert f"left by process {me}" in caplog.text
