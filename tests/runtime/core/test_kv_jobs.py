"""KV jobs: regression scenarios of the known failure modes (preemption with a store in flight,
request-id reuse with a late completion) and the lifecycle's error cases."""

import pytest

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj

BS = 4


def cache(num_blocks=6):
    return kvc.make_kv_cache(num_blocks, BS, max_model_len=64)


def admit(kv, req_id, tokens):
    hashes = kvc.extend_block_hashes((), tokens, BS)
    result = kvc.allocate_slots(kv, req_id, len(tokens), 0, block_hashes=hashes)
    assert isinstance(result, kvc.Allocated)
    return result.state, hashes


def test_preempted_request_blocks_stay_pinned_until_the_store_ends():
    kv, jobs = cache(), kj.make_kv_jobs()
    kv, hashes = admit(kv, "a", list(range(12)))
    table = kvc.blocks_of(kv, "a")
    jobs, kv, job = kj.plan_store(jobs, kv, "a", table, hashes)
    assert [bp.ref_count(kv.pool, b) for b in table] == [2, 2, 2]
    jobs = kj.detach_request(jobs, "a")  # preemption: a drops its references now
    kv = kvc.free(kv, "a")
    assert [bp.ref_count(kv.pool, b) for b in table] == [1, 1, 1]
    assert kvc.num_free_blocks(kv) == 2
    # Another request wants every free block: it gets the two never-used ones, not a's.
    kv, _ = admit(kv, "b", [100 + t for t in range(8)])
    assert not set(kvc.blocks_of(kv, "b")) & set(table)
    assert isinstance(kvc.allocate_slots(kv, "c", 1, 0), kvc.CannotAllocate)
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))
    jobs, kv, ended = kj.complete_job(jobs, kv, job.job_id)
    assert ended == job and not kj.has_jobs_in_flight(jobs)
    # Unpinned tail-first, so a's shared prefix is evicted last.
    assert bp.free_order(kv.pool) == tuple(reversed(table))
    assert jobs.stats.blocks_stored == 3 and set(jobs.stored) == set(hashes)
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))


def test_late_load_of_an_earlier_request_with_the_same_id_leaves_the_new_one_alone():
    kv, jobs = cache(8), kj.make_kv_jobs()
    tokens = list(range(9))
    hashes = kvc.extend_block_hashes((), tokens, BS)
    jobs = kj.note_stored(jobs, hashes)
    loads = []
    for _ in range(2):  # the first "r" is aborted while loading; a new "r" arrives
        kv = kvc.allocate_slots(kv, "r", 8, 0).state
        jobs, kv, job = kj.plan_load(jobs, kv, "r", kvc.blocks_of(kv, "r")[:2], hashes[:2], 0)
        loads.append(job)
        if len(loads) == 1:
            jobs = kj.detach_request(jobs, "r")
            kv = kvc.free(kv, "r")
    old, new = loads
    assert new.job_id > old.job_id and jobs.loading["r"] == new.job_id
    assert not set(old.block_ids) & set(new.block_ids)
    jobs, kv, _ = kj.complete_job(jobs, kv, old.job_id)
    assert jobs.loading["r"] == new.job_id  # the new lifecycle still waits for its own load
    assert all(bp.is_free(kv.pool, b) for b in old.block_ids)
    jobs, kv, _ = kj.fail_job(jobs, kv, new.job_id)
    assert "r" not in jobs.loading
    # A failed load forgets those hashes, so they are recomputed rather than loaded again.
    assert kj.stored_run(jobs, hashes, 0, 2) == 0
    assert jobs.stats == kj.OffloadStats(blocks_loaded=2, hit_tokens=8, load_failures=1)
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))


def test_store_plans_only_blocks_not_stored_or_being_stored():
    kv, jobs = cache(8), kj.make_kv_jobs()
    kv, hashes = admit(kv, "a", list(range(8)))
    table = kvc.blocks_of(kv, "a")
    jobs, kv, first = kj.plan_store(jobs, kv, "a", table[:1], hashes[:1])
    jobs, kv, second = kj.plan_store(jobs, kv, "a", table, hashes)
    assert second.block_ids == table[1:]
    jobs, kv, none = kj.plan_store(jobs, kv, "a", table, hashes)
    assert none is None
    jobs, kv, _ = kj.fail_job(jobs, kv, first.job_id)
    jobs, kv, third = kj.plan_store(jobs, kv, "a", table, hashes)
    assert third.block_ids == table[:1]  # a failed store is planned again
    jobs, kv, _ = kj.complete_job(jobs, kv, second.job_id, evicted=hashes[1:])
    assert kj.stored_run(jobs, hashes, 0, 2) == 0  # evicted by the store meanwhile
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))


def test_misuse_raises_and_names_the_problem():
    kv, jobs = cache(8), kj.make_kv_jobs()
    kv, hashes = admit(kv, "a", list(range(8)))
    table = kvc.blocks_of(kv, "a")
    with pytest.raises(kj.KVJobError, match="2 blocks but 1 hashes"):
        kj.plan_store(jobs, kv, "a", table, hashes[:1])
    with pytest.raises(kj.KVJobError, match="not registered under hash"):
        kj.plan_store(jobs, kv, "a", table[:1], hashes[1:])
    with pytest.raises(kj.KVJobError, match="already a cached prefix block"):
        kj.plan_load(jobs, kv, "a", table[:1], hashes[:1], 0)
    with pytest.raises(kj.KVJobError, match="KV job 1 was never planned"):
        kj.complete_job(jobs, kv, 1)
    jobs, kv, job = kj.plan_store(jobs, kv, "a", table, hashes)
    kv = kvc.free(kv, "a")
    jobs, kv, _ = kj.complete_job(jobs, kv, job.job_id)
    with pytest.raises(kj.KVJobError, match="KV job 1 already ended"):
        kj.fail_job(jobs, kv, job.job_id)
    with pytest.raises(kj.KVJobError, match="is free; nothing to read"):
        kj.plan_store(jobs, kv, "a", table, hashes)
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))
