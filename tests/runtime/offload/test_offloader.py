"""The offload shell on real device arrays and a real HostStore: block copies, the worker's
exactly-once reports, and the regression scenarios (preemption with a store in flight, a store
that fails half of its puts)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj
from runtime.offload.device_copy import block_nbytes, gather_blocks, rows_to_host, scatter_blocks
from runtime.offload.host_store import HostStore
from runtime.offload.offloader import KVOffloader
from runtime.offload.store import PutResult

NUM_BLOCKS, BS, HKV, D, LAYERS = 8, 4, 2, 8, 2


def make_kv(seed=0):
    keys = jax.random.split(jax.random.key(seed), 2 * LAYERS)
    shape = (NUM_BLOCKS, BS, HKV, D)
    return tuple(
        (
            jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16),
        )
        for i in range(LAYERS)
    )


def block_rows(kv, blocks):
    """A block's bytes straight from the arrays, independently of device_copy."""
    return [b"".join(np.asarray(a[b]).tobytes() for layer in kv for a in layer) for b in blocks]


def test_gather_scatter_round_trip_and_untrusted_bytes():
    kv = make_kv()
    assert block_nbytes(kv) == LAYERS * 2 * BS * HKV * D * 2
    for blocks in ([3, 6], [5, 1, 2]):  # the second is padded to 4
        rows = rows_to_host(*gather_blocks(kv, blocks))
        assert [r.tobytes() for r in rows] == block_rows(kv, blocks)
        target = tuple(
            (jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan)) for k, v in make_kv(1)
        )
        dest = list(reversed(range(1, 1 + len(blocks))))
        target, finite = scatter_blocks(target, dest, rows)
        assert finite and block_rows(target, dest) == block_rows(kv, blocks)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dest]
        assert all(np.isnan(np.asarray(target[0][0][b], np.float32)).all() for b in untouched)
    bad = rows_to_host(*gather_blocks(kv, [1, 2])).copy()
    bad[1, :2] = 0xFF  # a bf16 NaN from the "store"
    _, finite = scatter_blocks(make_kv(2), [3, 4], bad)
    assert not finite
    with pytest.raises(ValueError, match=r"rows of shape \(2, 512\), expected \(1, 512\)"):
        scatter_blocks(make_kv(2), [3], bad)


class GatedStore(HostStore):
    """A HostStore whose puts wait for a gate (a store job kept in flight on purpose) and that
    can fail every other key (a store under pressure)."""

    def __init__(self, *args, fail_every_other=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.fail_every_other = fail_every_other

    def put(self, keys, values):
        # The test opens the gate; the bound only turns a test that never does into a failure
        # (a put that went ahead on a timeout would end the job the test means to keep in flight).
        if not self.gate.wait(timeout=600):
            raise TimeoutError("GatedStore.put: the test never opened the gate")
        if not self.fail_every_other:
            return super().put(keys, values)
        kept = [i for i in range(len(keys)) if i % 2 == 0]
        super().put([keys[i] for i in kept], [values[i] for i in kept])
        return PutResult(stored=tuple(i % 2 == 0 for i in range(len(keys))))


def admit(kv_state, req_id, tokens):
    hashes = kvc.extend_block_hashes((), tokens, BS)
    kv_state = kvc.allocate_slots(kv_state, req_id, len(tokens), 0, block_hashes=hashes).state
    return kv_state, hashes


def drain(offloader, kv, expected):
    results = []
    while len(results) < expected:
        kv, done = offloader.finish(kv, wait_s=10)
        results.extend(done)
    return kv, results


def test_preempted_request_store_saves_its_own_kv_and_its_blocks_wait(tmp_path):
    kv = make_kv()
    store = GatedStore(64 * block_nbytes(kv), block_nbytes(kv), shm_dir=str(tmp_path))
    offloader = KVOffloader(store)
    state, jobs = kvc.make_kv_cache(NUM_BLOCKS, BS, max_model_len=64), kj.make_kv_jobs()
    state, hashes = admit(state, "a", list(range(12)))
    a_blocks = kvc.blocks_of(state, "a")
    a_kv = block_rows(kv, a_blocks)
    jobs, state, job = kj.plan_store(jobs, state, "a", a_blocks, hashes)
    offloader.start(kv, [job])
    # Preempt a; b wants every free block and writes its own KV into them.
    jobs = kj.detach_request(jobs, "a")
    state = kvc.free(state, "a")
    state, _ = admit(state, "b", list(range(50, 66)))
    b_blocks = kvc.blocks_of(state, "b")
    assert not set(b_blocks) & set(a_blocks)
    assert isinstance(kvc.allocate_slots(state, "c", 1, 0), kvc.CannotAllocate)
    new_rows = rows_to_host(*gather_blocks(make_kv(7), b_blocks))
    kv, _ = scatter_blocks(kv, b_blocks, new_rows)  # donates the old arrays, as a step does
    assert offloader.num_in_flight == 1
    store.gate.set()
    kv, results = drain(offloader, kv, 1)
    assert results == [kj.KVJobResult(job.job_id, True)]
    jobs, state, _ = kj.end_job(jobs, state, results[0])
    assert list(store.get(hashes)) == a_kv
    assert kvc.num_free_blocks(state) == 3  # a's blocks come back only now
    kvc.check_invariants(state, extra_holders=kj.pins(jobs))
    offloader.close()


def test_a_store_failing_half_its_puts_fails_the_job_and_loads_fall_back(tmp_path):
    kv = make_kv()
    store = GatedStore(
        64 * block_nbytes(kv), block_nbytes(kv), shm_dir=str(tmp_path), fail_every_other=True
    )
    store.gate.set()
    offloader = KVOffloader(store)
    state, jobs = kvc.make_kv_cache(NUM_BLOCKS, BS, max_model_len=64), kj.make_kv_jobs()
    state, hashes = admit(state, "a", list(range(16)))
    jobs, state, job = kj.plan_store(jobs, state, "a", kvc.blocks_of(state, "a"), hashes)
    offloader.start(kv, [job])
    kv, results = drain(offloader, kv, 1)
    assert results == [kj.KVJobResult(job.job_id, False)]
    assert "2 of 4 blocks were not stored" in offloader.errors[-1]
    jobs, state, _ = kj.end_job(jobs, state, results[0])
    assert not jobs.stored and jobs.stats.store_failures == 1
    # The store itself holds half the blocks; a load of all four fails and is reported.
    state = kvc.free(state, "a")
    jobs = kj.note_stored(jobs, hashes)
    state = kvc.allocate_slots(state, "r", 16, 0).state
    jobs, state, load = kj.plan_load(jobs, state, "r", kvc.blocks_of(state, "r"), hashes, 0)
    offloader.start(kv, [load])
    kv, results = drain(offloader, kv, 1)
    assert results == [kj.KVJobResult(load.job_id, False)]
    assert "2 of 4 blocks are not in the store" in offloader.errors[-1]
    jobs, state, _ = kj.end_job(jobs, state, results[0])
    assert kj.stored_run(jobs, hashes, 0, 4) == 0 and jobs.stats.load_failures == 1
    kvc.check_invariants(state, extra_holders=kj.pins(jobs))
    offloader.close()


def test_load_writes_the_stored_bytes(tmp_path):
    kv = make_kv()
    store = HostStore(64 * block_nbytes(kv), block_nbytes(kv), shm_dir=str(tmp_path))
    offloader = KVOffloader(store)
    state, jobs = kvc.make_kv_cache(NUM_BLOCKS, BS, max_model_len=64), kj.make_kv_jobs()
    state, hashes = admit(state, "a", list(range(8)))
    a_blocks = kvc.blocks_of(state, "a")
    jobs, state, job = kj.plan_store(jobs, state, "a", a_blocks, hashes)
    offloader.start(kv, [job])
    kv, results = drain(offloader, kv, 1)
    jobs, state, _ = kj.end_job(jobs, state, results[0])
    assert offloader.stored_prefix(hashes + (b"\0" * 32,)) == hashes
    state = kvc.allocate_slots(state, "r", 8, 0).state
    r_blocks = kvc.blocks_of(state, "r")
    jobs, state, load = kj.plan_load(jobs, state, "r", r_blocks, hashes, 0)
    offloader.start(kv, [load])
    kv, results = drain(offloader, kv, 1)
    assert results == [kj.KVJobResult(load.job_id, True)]
    assert block_rows(kv, r_blocks) == block_rows(kv, a_blocks)
    offloader.close()
