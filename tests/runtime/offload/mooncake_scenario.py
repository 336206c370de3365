"""Mooncake store checks, run as `unshare -n python3 tests/runtime/offload/mooncake_scenario.py`.

Some of Mooncake's sockets bind 0.0.0.0 whatever address is asked for, so this script refuses to
run outside a private network namespace (one whose only interface is loopback). It brings lo
up, starts mooncake_master on a high loopback port, runs the checks, stops the master by its
pid, and exits non-zero (with the failure printed) if any check fails.
"""

import hashlib
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

PORT = 47651
MASTER = f"127.0.0.1:{PORT}"
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


def start_master() -> subprocess.Popen:
    return subprocess.Popen(
        [
            "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={PORT}",
            "--metrics_port",
            str(PORT + 1),
            "--default_kv_lease_ttl=100",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def connect(**kwargs):
    from runtime.offload.mooncake_store import MooncakeStore
    from runtime.offload.store import StoreError

    deadline = time.monotonic() + 20
    while True:
        try:
            return MooncakeStore(MASTER, BLOCK, namespace="scenario", **kwargs)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


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
    # A 16 MiB segment (the smallest allowed) cannot take 512 blocks of 64 KiB: puts that find
    # no space even after the retries come back as not stored, never as a silent success.
    slept = []
    with connect(segment_bytes=16 << 20, buffer_bytes=16 << 20, retries=2, sleep=slept.append) as s:
        keys = [key(1000 + i) for i in range(512)]
        stored = s.put(keys, [value(i) for i in range(512)]).stored
        assert not all(stored), "a full pool reported every put as stored"
        # The pool evicts (asynchronously) to make room, so only some stored keys remain.
        last = max(i for i, ok in enumerate(stored) if ok)
        assert s.get([keys[last]]) in ((value(last),), (None,))
        assert slept and slept[:2] == [0.01, 0.02], slept
    print(f"full pool ok: {sum(stored)} of 512 stored, backoff {slept[:2]}")


def check_jobs_through_the_worker() -> None:
    import jax
    import jax.numpy as jnp

    from runtime.core import kv_cache as kvc
    from runtime.core import kv_jobs as kj
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
    kv, done = offloader.finish(kv, wait_s=20)
    assert done == (kj.KVJobResult(job.job_id, True),), (done, offloader.errors)
    jobs, state, _ = kj.end_job(jobs, state, done[0])
    assert offloader.stored_prefix(hashes) == hashes
    state = kvc.allocate_slots(kvc.free(state, "a"), "r", 48, 0).state
    target = kvc.blocks_of(state, "r")
    jobs, state, load = kj.plan_load(jobs, state, "r", target, hashes, 0)
    offloader.start(kv, [load])
    kv, done = offloader.finish(kv, wait_s=20)
    assert done == (kj.KVJobResult(load.job_id, True),), (done, offloader.errors)
    source = job.block_ids
    for layer in kv:
        for array in layer:
            assert bool((array[jnp.asarray(target)] == array[jnp.asarray(source)]).all())
    offloader.close()
    print("jobs ok")


def main() -> int:
    check_private_network()
    master = start_master()
    try:
        check_store_semantics()
        check_full_pool_is_reported()
        check_jobs_through_the_worker()
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(timeout=10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
    print("MOONCAKE SCENARIO PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
