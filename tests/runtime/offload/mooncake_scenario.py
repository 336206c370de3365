"""Mooncake store checks, run as `unshare -n python3 tests/runtime/offload/mooncake_scenario.py`.

Some of Mooncake's sockets bind 0.0.0.0 whatever address is asked for, so this script refuses to
run outside a private network namespace (one whose only interface is loopback). It brings lo
up, starts mooncake_master on a high loopback port, runs the checks, stops the master by its
pid, and exits non-zero (with the failure printed) if any check fails.

The master evicts from a background thread that wakes every 10 ms, and a freshly written object
carries no lease, so it can go at once. What a full pool holds therefore depends on when that
thread runs: under load it kept up with the retries and every put landed ("a full pool reported
every put as stored", 2 runs in 3 beside two busy loops). So the master these checks share never
evicts (high watermark 1.0, eviction ratio 0), and the pool's contents are exactly what the puts
reported; one check runs against a second, evicting master and asserts only what holds under
every schedule.
"""

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

from benchmarks import mooncake_master  # noqa: E402

PORT = 47651
MASTER = f"127.0.0.1:{PORT}"
EVICTING_PORT = PORT + 2
BLOCK = 64 << 10


def key(i: int) -> bytes:
    return hashlib.sha256(b"mooncake block %d" % i).digest()


def value(i: int, nbytes: int = BLOCK) -> bytes:
    return (i.to_bytes(4, "little") * (nbytes // 4))[:nbytes]


def check_private_network() -> None:
    # /sys/class/net shows the host's interfaces in a new netns; `ip` asks the namespace itself.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    interfaces = {line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines()}
    if interfaces != {"lo"}:
        sys.exit(f"refusing to start mooncake_master outside a private netns: {interfaces}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def start_master(port: int = PORT, *, evicts: bool = False) -> subprocess.Popen:
    """mooncake_master on 127.0.0.1:port (metrics on port + 1), returned once it listens on both;
    unless `evicts`, one that never evicts anything.

    Eviction runs when the used ratio passes the high watermark or, after a failed allocation,
    when the eviction ratio is above 0: with 1.0 and 0.0 neither can happen.

    Start masters before any client exists: the ports lie in the ephemeral range, and a master
    whose port a client connection took as its source port exits at once (it did in 1 of 10
    loaded runs, when the evicting master was started mid-scenario). A port something listens on
    is never handed out as a source port.
    """
    eviction = [] if evicts else ["--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0.0"]
    # The master keeps its own descriptor of the log; this one is only read if it fails.
    with tempfile.TemporaryFile() as log:
        master = subprocess.Popen(
            [
                "mooncake_master",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={port}",
                "--metrics_port",
                str(port + 1),
                # A get leases its object; a read whose transfer outlasts the lease fails with
                # LEASE_EXPIRED. 100 ms did under two busy loops (3 loads lost in the engine
                # scenario): a lease is a bound on a transfer, so give it one no load reaches.
                "--default_kv_lease_ttl=600000",
                *eviction,
            ],
            stdout=log,
            stderr=log,
            # A scenario killed by its test's timeout never reaches its `finally`: the master must
            # go with it rather than outlive it in the orphaned namespace.
            preexec_fn=_die_with_parent,
        )
        _wait_until_listening(master, {port, port + 1}, log)
    return master


def _listening_ports() -> set[int]:
    """TCP ports something listens on in this namespace, read from /proc (opening no socket)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _wait_until_listening(master: subprocess.Popen, ports: set[int], log) -> None:
    """Poll until the master listens on `ports`; a master that exits instead fails the scenario
    at once with its log (the deadline only bounds one that hangs)."""
    deadline = time.monotonic() + 120
    while not ports <= _listening_ports():
        if master.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            sys.exit(f"mooncake_master (exit {master.poll()}) never listened on {ports}:\n{tail}")
        time.sleep(0.05)


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_master(master: subprocess.Popen) -> None:
    mooncake_master.stop_master(master, grace_s=30)


def connect(port: int = PORT, **kwargs):
    """A store on a master that may still be starting: setup is retried until it answers (the
    deadline only bounds a master that never comes up)."""
    return mooncake_master.connect_store(port, BLOCK, namespace="scenario", timeout_s=120, **kwargs)


def check_store_semantics() -> None:
    with connect(segment_bytes=64 << 20, buffer_bytes=16 << 20) as store:
        keys = [key(i) for i in range(300)]
        assert store.exists(keys[:3]) == (False,) * 3
        # 300 blocks of 64 KiB do not fit one 16 MiB staging buffer: the put is split.
        assert store.put(keys, [value(i) for i in range(300)]).stored == (True,) * 300
        assert store.get(keys[:2] + [key(999)]) == (value(0), value(1), None)
        assert store.exists([keys[5], key(999)]) == (True, False)
        assert store.put(keys[:1], [value(7)]).stored == (True,)  # re-store: upsert
        assert store.get(keys[:1]) == (value(7),)
        assert store.remove(keys[:2]) == 2 and store.exists(keys[:2]) == (False, False)
    print("semantics ok")


def check_full_pool_is_reported() -> None:
    # A 16 MiB segment (the smallest allowed) holds at most 256 blocks of 64 KiB and this master
    # frees nothing, so of 512 puts at least 256 find no space even after the retries: they come
    # back as not stored, never as a silent success, and the pool holds exactly what was reported.
    slept = []
    with connect(segment_bytes=16 << 20, buffer_bytes=16 << 20, retries=2, sleep=slept.append) as s:
        keys = [key(1000 + i) for i in range(512)]
        stored = s.put(keys, [value(i) for i in range(512)]).stored
        assert not all(stored), "a full pool reported every put as stored"
        assert 0 < sum(stored) <= 256, sum(stored)
        expected = tuple(value(i) if ok else None for i, ok in enumerate(stored))
        assert s.get(keys) == expected, "the pool holds other blocks than the puts reported"
        # Each block that found no space was tried 1 + 2 times, backing off 10 ms then 20 ms.
        assert slept == [0.01, 0.02] * (512 - sum(stored)), slept[:4]
    print(f"full pool ok: {sum(stored)} of 512 stored, backoff {slept[:2]}")


def check_evicting_pool_returns_what_was_written() -> None:
    # With eviction on, which puts land and which stored blocks survive depend on when the
    # master's eviction thread runs. Under every schedule: no put raises, and a read gives the
    # value written to that key or nothing.
    with connect(EVICTING_PORT, segment_bytes=16 << 20, retries=2, sleep=lambda s: None) as s:
        keys = [key(2000 + i) for i in range(512)]
        stored = s.put(keys, [value(i) for i in range(512)]).stored
        got = s.get(keys)
        wrong = [i for i, v in enumerate(got) if v not in (value(i), None)]
        assert not wrong, f"blocks {wrong[:8]} read back bytes that were never written there"
    left = sum(v is not None for v in got)
    print(f"evicting pool ok: {sum(stored)} of 512 stored, {left} left")


def check_jobs_through_the_worker() -> None:
    import jax
    import jax.numpy as jnp

    from runtime.core.kv import kv_cache as kvc
    from runtime.core.kv_jobs import jobs as kj
    from runtime.offload.device_copy import block_nbytes
    from runtime.offload.mooncake_store import MooncakeStore
    from runtime.offload.offloader import KVOffloader

    shape = (8, 16, 2, 64)  # 64 KiB per block over 2 layers of bf16 k and v
    keys = jax.random.split(jax.random.key(0), 4)
    kv = tuple(
        (
            jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16),
        )
        for i in range(2)
    )
    nbytes = block_nbytes(kv)
    store = MooncakeStore(MASTER, nbytes, namespace="jobs", segment_bytes=32 << 20)
    offloader = KVOffloader(store)
    state, jobs = kvc.make_kv_cache(8, 16, max_model_len=128), kj.make_kv_jobs()
    tokens = list(range(48))
    hashes = kvc.extend_block_hashes((), tokens, 16)
    state = kvc.allocate_slots(state, "a", 48, 0, block_hashes=hashes).state
    jobs, state, job = kj.plan_store(jobs, state, "a", kvc.blocks_of(state, "a"), hashes)
    offloader.start(kv, [job])
    kv, done = offloader.finish(kv, wait_s=120)
    assert done == (kj.KVJobResult(job.job_id, True),), (done, offloader.errors)
    jobs, state, _ = kj.end_job(jobs, state, done[0])
    assert offloader.stored_prefix(hashes) == hashes
    state = kvc.allocate_slots(kvc.free(state, "a"), "r", 48, 0).state
    target = kvc.blocks_of(state, "r")
    jobs, state, load = kj.plan_load(jobs, state, "r", target, hashes, 0)
    offloader.start(kv, [load])
    kv, done = offloader.finish(kv, wait_s=120)
    assert done == (kj.KVJobResult(load.job_id, True),), (done, offloader.errors)
    source = job.block_ids
    for layer in kv:
        for array in layer:
            assert bool((array[jnp.asarray(target)] == array[jnp.asarray(source)]).all())
    offloader.close()
    print("jobs ok")


def main() -> int:
    check_private_network()
    masters = [start_master(), start_master(EVICTING_PORT, evicts=True)]  # before any client
    try:
        check_store_semantics()
        check_full_pool_is_reported()
        check_evicting_pool_returns_what_was_written()
        check_jobs_through_the_worker()
    finally:
        for master in masters:
            stop_master(master)
    print("MOONCAKE SCENARIO PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
