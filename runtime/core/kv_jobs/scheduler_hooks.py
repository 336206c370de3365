"""The scheduler's KV-job hooks: loads in schedule()'s waiting loop, stores after it, job ends
in update().

Kept apart from the scheduler proper: with `state.kv_jobs is None` (no KV store) none of this
runs. The lifecycle of a request with a load, as vLLM 0.33's connector path:
- schedule (waiting loop, vLLM order): a waiting request whose prefix the store holds beyond its
  local prefix-cache hit gets a block table (local hit + blocks for the stored run, not yet
  registered as cached) and a load job pinning the new blocks, if they fit beside what requests
  already prefilling or loading still need. It moves to `kv_jobs.holding` with status
  WAITING_FOR_REMOTE_KV; it takes no running slot and no token budget;
- update: the load's end is noted in `kv_jobs.arrived`; the request keeps its blocks;
- schedule: the waiting loop takes up `holding` before the waiting queue. A request whose load
  arrived registers the loaded blocks as cached and counts them computed (or, after a failure,
  drops its blocks and is admitted afresh), then is admitted like any other, keeping its place
  in `holding` until it is. No other request can take its blocks in between.
Stores: every step, the blocks of running requests that became full (hashed) since the last step
are stored, so a request that finishes or is preempted has all its full blocks stored or storing.
A request that skips reading the prefix cache (prompt logprobs) loads nothing, but is stored.
"""

from dataclasses import replace

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj
from runtime.core.kv_jobs.jobs import KVJobResult, LoadJob
from runtime.core.outputs import SchedulerOutput
from runtime.core.request import Request, RequestStatus, evolve
from runtime.core.scheduling.scheduler_state import SchedulerError, SchedulerState, evolve_state

__all__ = [
    "apply_kv_job_results",
    "blocks_to_finish",
    "detach_finished",
    "enable_kv_jobs",
    "has_pending_kv_jobs",
    "plan_stores",
    "start_load",
    "stored_beyond",
    "take_up_load",
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
    return evolve_state(state, kv_jobs=kj.make_kv_jobs())


def has_pending_kv_jobs(state: SchedulerState) -> bool:
    """The engine keeps stepping while this holds: job ends arrive only with a step."""
    return state.kv_jobs is not None and kj.has_jobs_in_flight(state.kv_jobs)


def stored_beyond(jobs: kj.KVJobs, request: Request, hit: kvc.CachedPrefix, block_size: int) -> int:
    """How many blocks past the local hit the store holds in a row (what a load would bring),
    leaving the last token to compute, as a local hit does."""
    if not jobs.stored:
        return 0
    max_blocks = (request.num_tokens - 1) // block_size
    return kj.stored_run(jobs, request.block_hashes, len(hit.blocks), max_blocks)


def blocks_to_finish(kv: kvc.KVCache, request: Request) -> int:
    """Blocks the request still lacks to hold all its tokens (vLLM's _request_remaining_blocks)."""
    table = kv.tables.get(request.request_id, ())
    num_tokens = min(request.num_tokens, kv.max_model_len)
    return max(0, -(-num_tokens // kv.pool.block_size) - len(table))


def start_load(
    jobs: kj.KVJobs,
    kv: kvc.KVCache,
    request: Request,
    hit: kvc.CachedPrefix,
    num_remote: int,
    reserved: int,
) -> tuple[kj.KVJobs, kvc.KVCache, LoadJob] | None:
    """Give the request its local hit plus `num_remote` blocks for the stored run, and a job
    loading them; None if those blocks do not fit beside the `reserved` ones (vLLM's
    reserved_blocks: what requests already prefilling or loading still need, so a load, which
    holds its blocks without progress, cannot starve them)."""
    request_id = request.request_id
    revived = sum(1 for block in hit.blocks if bp.is_free(kv.pool, block))
    if num_remote + revived > kvc.num_free_blocks(kv) - reserved:
        return None
    block_size = kv.pool.block_size
    # No block hashes: the loaded blocks are registered once their KV has arrived.
    result = kvc.allocate_slots(kv, request_id, num_remote * block_size, 0, hit.blocks)
    if not isinstance(result, kvc.Allocated):
        raise SchedulerError(
            f"start_load({request_id!r}): {num_remote} + {revived} blocks fit the free count "
            f"but allocate_slots refused them ({result})"
        )
    first = len(hit.blocks)
    table = kvc.blocks_of(result.state, request_id)
    return kj.plan_load(
        jobs,
        result.state,
        request_id,
        table[first : first + num_remote],
        request.block_hashes[first : first + num_remote],
        hit.num_tokens,
    )


def take_up_load(
    jobs: kj.KVJobs, kv: kvc.KVCache, request: Request
) -> tuple[kj.KVJobs, kvc.KVCache, Request]:
    """The request's load ended (vLLM's _update_waiting_for_remote_kv): after a success the
    loaded blocks become cached prefix blocks and count as computed; after a failure the request
    drops its blocks and is admitted afresh, recomputing what the load would have brought."""
    request_id = request.request_id
    job, ok = jobs.arrived[request_id]
    jobs = replace(jobs, arrived=jobs.arrived.delete(request_id))
    status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
    if not ok:
        return jobs, kvc.free(kv, request_id), evolve(request, status=status)
    table = kvc.blocks_of(kv, request_id)
    first = job.first_token // kv.pool.block_size
    if table[first:] != job.block_ids or kv.num_cached[request_id] != first:
        raise SchedulerError(
            f"take_up_load({request_id!r}): table {table} with {kv.num_cached[request_id]} "
            f"cached blocks does not end with load {job.job_id}'s blocks {job.block_ids}"
        )
    kv = replace(
        kv,
        pool=bp.cache_blocks(kv.pool, job.block_ids, job.block_hashes),
        num_cached=kv.num_cached.set(request_id, len(table)),
    )
    computed = len(table) * kv.pool.block_size
    return jobs, kv, evolve(request, status=status, num_computed_tokens=computed)


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
    state = evolve_state(state, kv=kv, kv_jobs=jobs)
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
    """Apply the ends the shell reported: unpin, record what is stored, note arrived loads (the
    request keeps its blocks; the next schedule() takes it up)."""
    if not results:
        return state
    jobs = state.kv_jobs
    if jobs is None:
        raise SchedulerError("KV job results given, but KV jobs are not enabled")
    kv, arrived = state.kv, jobs.arrived
    for result in results:
        job = jobs.in_flight.get(result.job_id)
        owned = isinstance(job, LoadJob) and jobs.loading.get(job.req_id) == job.job_id
        jobs, kv, job = kj.end_job(jobs, kv, result)
        if owned:
            arrived = arrived.set(job.req_id, (job, result.ok))
    return evolve_state(state, kv=kv, kv_jobs=replace(jobs, arrived=arrived))
