"""The scheduler's KV-job hooks: plan loads and stores in schedule(), apply job ends in update().

Kept apart from the scheduler proper: with `state.kv_jobs is None` (no KV store) every hook is
the identity. The lifecycle of a request with a load:
- schedule: a waiting request whose prefix the store holds beyond the local prefix-cache hit gets
  a block table (local hit + blocks for the stored run, not yet registered as cached) and a load
  job pinning the new blocks; it leaves the waiting queue with status WAITING_FOR_REMOTE_KV;
- update: when the load ends, a success registers the loaded blocks under their hashes; either
  way the request drops its table and goes back to the head of the queue, to be admitted by the
  ordinary path, which now finds the loaded blocks as a local prefix hit (or, after a failure,
  recomputes those tokens).
Stores: every step, the blocks of running requests that became full (hashed) since the last step
are stored, so a request that finishes or is preempted has all its full blocks stored or storing.
"""

from dataclasses import replace

from runtime.core import block_pool as bp
from runtime.core import kv_cache as kvc
from runtime.core import kv_jobs as kj
from runtime.core.kv_jobs import KVJobResult, LoadJob
from runtime.core.outputs import SchedulerOutput
from runtime.core.request import RequestStatus, evolve
from runtime.core.scheduler_state import SchedulerError, SchedulerState, with_waiting

__all__ = [
    "apply_kv_job_results",
    "detach_finished",
    "enable_kv_jobs",
    "has_pending_kv_jobs",
    "plan_loads",
    "plan_stores",
]


def enable_kv_jobs(state: SchedulerState) -> SchedulerState:
    """Turn on KV store jobs for a fresh scheduler state."""
    if state.kv_jobs is not None:
        raise SchedulerError("enable_kv_jobs: KV jobs are already enabled")
    if not state.config.enable_prefix_caching:
        raise SchedulerError(
            "enable_kv_jobs: a KV store is keyed by prefix-cache block hashes; "
            "it needs enable_prefix_caching=True"
        )
    return replace(state, kv_jobs=kj.make_kv_jobs())


def has_pending_kv_jobs(state: SchedulerState) -> bool:
    """The engine keeps stepping while this holds: job ends arrive only with a step."""
    return state.kv_jobs is not None and kj.has_jobs_in_flight(state.kv_jobs)


def plan_loads(state: SchedulerState) -> tuple[SchedulerState, tuple[LoadJob, ...]]:
    """Start loads for waiting requests whose stored prefix reaches past their local hit."""
    jobs = state.kv_jobs
    if jobs is None or not jobs.stored or not state.waiting:
        return state, ()
    config = state.config
    block_size = config.block_size
    slots = config.max_num_seqs - len(state.running) - len(jobs.loading)
    kv, requests, loads, started = state.kv, state.requests, [], set()
    for request_id in state.waiting[: max(0, slots)]:
        request = requests[request_id]
        if request.skip_reading_prefix_cache:
            continue  # it reads nothing back: neither the local cache nor the store (as vLLM)
        hit = kvc.find_cached_prefix(kv, request)
        max_blocks = (request.num_tokens - 1) // block_size
        num_remote = kj.stored_run(jobs, request.block_hashes, len(hit.blocks), max_blocks)
        if num_remote == 0:
            continue
        # Leave one free block per running request, so loads do not force preemptions.
        revived = sum(1 for b in hit.blocks if bp.is_free(kv.pool, b))
        if kvc.num_free_blocks(kv) - num_remote - revived < len(state.running):
            break
        result = kvc.allocate_slots(kv, request_id, num_remote * block_size, 0, hit.blocks)
        if not isinstance(result, kvc.Allocated):
            break
        first = len(hit.blocks)
        table = kvc.blocks_of(result.state, request_id)
        jobs, kv, job = kj.plan_load(
            jobs,
            result.state,
            request_id,
            table[first : first + num_remote],
            request.block_hashes[first : first + num_remote],
            hit.num_tokens,
        )
        requests = requests.set(
            request_id, evolve(request, status=RequestStatus.WAITING_FOR_REMOTE_KV)
        )
        loads.append(job)
        started.add(request_id)
    if not loads:
        return state, ()
    waiting = tuple(r for r in state.waiting if r not in started)
    return replace(state, kv=kv, requests=requests, waiting=waiting, kv_jobs=jobs), tuple(loads)


def plan_stores(
    state: SchedulerState, output: SchedulerOutput, loads: tuple[LoadJob, ...] = ()
) -> tuple[SchedulerState, SchedulerOutput]:
    """Store the blocks of running requests hashed since the last step; put every job planned
    this step (`loads` too) into the output."""
    jobs = state.kv_jobs
    if jobs is None:
        return state, output
    for request_id in output.preempted_req_ids:
        jobs = kj.detach_request(jobs, request_id)
    kv, stores, cursor = state.kv, [], jobs.store_cursor.mutate()
    for request_id in state.running:
        num_cached = kv.num_cached[request_id]
        start = cursor.get(request_id, 0)
        if num_cached <= start:
            continue
        request = state.requests[request_id]
        table = kv.tables[request_id]
        jobs, kv, job = kj.plan_store(
            jobs, kv, request_id, table[start:num_cached], request.block_hashes[start:num_cached]
        )
        cursor[request_id] = num_cached
        if job is not None:
            stores.append(job)
    jobs = replace(jobs, store_cursor=cursor.finish())
    planned = loads + tuple(stores)
    state = replace(state, kv=kv, kv_jobs=jobs)
    return state, (replace(output, kv_jobs=planned) if planned else output)


def detach_finished(state: SchedulerState, request_ids) -> kj.KVJobs | None:
    """The KV jobs of a state whose requests `request_ids` just finished (their jobs keep pins)."""
    jobs = state.kv_jobs
    if jobs is None:
        return None
    for request_id in request_ids:
        jobs = kj.detach_request(jobs, request_id)
    return jobs


def apply_kv_job_results(state: SchedulerState, results: tuple[KVJobResult, ...]) -> SchedulerState:
    """Apply the ends the shell reported: unpin, record what is stored, release waiting loads."""
    if not results:
        return state
    jobs = state.kv_jobs
    if jobs is None:
        raise SchedulerError("KV job results given, but KV jobs are not enabled")
    kv, requests, released = state.kv, state.requests, []
    for result in results:
        job = jobs.in_flight.get(result.job_id)
        owned = isinstance(job, LoadJob) and jobs.loading.get(job.req_id) == job.job_id
        jobs, kv, job = kj.end_job(jobs, kv, result)
        if not owned:
            continue
        request = requests[job.req_id]
        if result.ok:
            # The blocks now hold the stored KV: make them a prefix-cache hit, then let the
            # request go; the ordinary admission path picks them up.
            kv = replace(kv, pool=bp.cache_blocks(kv.pool, job.block_ids, job.block_hashes))
        kv = kvc.free(kv, job.req_id)
        status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        requests = requests.set(job.req_id, evolve(request, status=status))
        released.append(job.req_id)
    waiting = state.waiting
    for request_id in reversed(released):
        waiting = with_waiting(waiting, requests, request_id, state.config.policy, front=True)
    return replace(state, kv=kv, requests=requests, waiting=waiting, kv_jobs=jobs)
