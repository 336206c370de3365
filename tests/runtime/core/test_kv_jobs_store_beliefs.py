"""What the jobs believe the KV store holds: keys the store reports evicted are forgotten one by
one, a key still being written is never offered for loading, and a key is stored once per job
even when two blocks hold it. (Each scenario let a one-line bug through the older tests.)"""

from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj

BS = 4


def _admit(kv, req_id, tokens):
    hashes = kvc.extend_block_hashes((), tokens, BS)
    result = kvc.allocate_slots(kv, req_id, len(tokens), 0, block_hashes=hashes)
    assert isinstance(result, kvc.Allocated)
    return result.state, hashes


def test_only_the_keys_reported_evicted_are_forgotten():
    kv, jobs = kvc.make_kv_cache(8, BS, max_model_len=64), kj.make_kv_jobs()
    kv, hashes = _admit(kv, "a", list(range(12)))
    jobs, kv, job = kj.plan_store(jobs, kv, "a", kvc.blocks_of(kv, "a"), hashes)
    # The store evicted the middle block while the job ran.
    jobs, kv, _ = kj.complete_job(jobs, kv, job.job_id, evicted=hashes[1:2])
    assert set(jobs.stored) == {hashes[0], hashes[2]}
    assert kj.stored_run(jobs, hashes, 0, 3) == 1
    assert kj.stored_run(jobs, hashes, 1, 3) == 0
    assert kj.stored_run(jobs, hashes, 2, 3) == 1
    # Evicted keys reported by a later job are forgotten too, stored ones kept.
    kv, other = _admit(kv, "b", list(range(100, 104)))
    jobs, kv, job = kj.plan_store(jobs, kv, "b", kvc.blocks_of(kv, "b"), other)
    jobs, kv, _ = kj.complete_job(jobs, kv, job.job_id, evicted=hashes[2:])
    assert set(jobs.stored) == {hashes[0], other[0]}
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))


def test_a_key_being_written_is_not_loadable_until_its_store_ends():
    kv, jobs = kvc.make_kv_cache(8, BS, max_model_len=64), kj.make_kv_jobs()
    kv, hashes = _admit(kv, "a", list(range(8)))
    jobs, kv, job = kj.plan_store(jobs, kv, "a", kvc.blocks_of(kv, "a"), hashes)
    # Another engine reports the same keys stored while this job still writes them.
    jobs = kj.note_stored(jobs, hashes)
    assert set(jobs.stored) == set(hashes)
    assert kj.stored_run(jobs, hashes, 0, 2) == 0
    jobs, kv, _ = kj.complete_job(jobs, kv, job.job_id)
    assert kj.stored_run(jobs, hashes, 0, 2) == 2


def test_two_blocks_holding_one_key_are_stored_once():
    kv, jobs = kvc.make_kv_cache(8, BS, max_model_len=64), kj.make_kv_jobs()
    # Two requests computed the same prefix at once: two blocks hold each key.
    kv, hashes = _admit(kv, "a", list(range(4)))
    kv, same = _admit(kv, "b", list(range(4)))
    assert same == hashes
    (a_block,), (b_block,) = kvc.blocks_of(kv, "a"), kvc.blocks_of(kv, "b")
    jobs, kv, job = kj.plan_store(jobs, kv, "a", (a_block, b_block), (hashes[0], hashes[0]))
    assert job.block_ids == (a_block,) and job.block_hashes == hashes
    jobs, kv, _ = kj.complete_job(jobs, kv, job.job_id)
    assert jobs.stats.blocks_stored == 1 and set(jobs.stored) == set(hashes)
    assert not jobs.storing and not kj.has_jobs_in_flight(jobs)
    kvc.check_invariants(kv, extra_holders=kj.pins(jobs))
