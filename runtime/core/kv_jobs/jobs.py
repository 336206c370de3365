"""KV store and load jobs: ids, block pins, completion and failure, as pure transitions.

A job holds one reference (a `kv_cache.pin`) on every block it reads (store) or writes (load) from
the moment it is planned until it ends, so a request that finishes or is preempted can drop its
own references at once without letting another request reuse a block the job still touches. Job
ids come from one counter that only increases, so a late completion can never be mistaken for a
later job, and a request id that is reused cannot receive an old lifecycle's load.
"""

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from immutables import Map

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv.block_pool import BlockHash
from runtime.core.kv.kv_cache import KVCache

__all__ = [
    "KVJobError",
    "KVJobResult",
    "KVJobs",
    "LoadJob",
    "OffloadStats",
    "StoreJob",
    "complete_job",
    "detach_request",
    "end_job",
    "fail_job",
    "forget_stored",
    "has_jobs_in_flight",
    "make_kv_jobs",
    "note_stored",
    "pins",
    "plan_load",
    "plan_store",
    "stored_run",
]


class KVJobError(ValueError):
    """Misuse of the job lifecycle; the states passed in are left as they were."""


@dataclass(frozen=True, slots=True)
class StoreJob:
    job_id: int
    req_id: str
    # Read by the job; block_hashes[i] is the key of block_ids[i].
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class LoadJob:
    job_id: int
    req_id: str
    # Written by the job; they hold the request's tokens first_token .. first_token + n * size.
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    first_token: int


KVJob = StoreJob | LoadJob


@dataclass(frozen=True, slots=True)
class KVJobResult:
    """How the shell reports a job's end: ok, or failed; plus keys the store evicted meanwhile."""

    job_id: int
    ok: bool
    evicted: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class OffloadStats:
    blocks_stored: int = 0
    blocks_loaded: int = 0
    hit_tokens: int = 0
    store_failures: int = 0
    load_failures: int = 0


@dataclass(frozen=True, slots=True)
class KVJobs:
    next_job_id: int
    in_flight: Map  # job id -> StoreJob | LoadJob
    # Hashes the store is believed to hold (a set: value True). Wrong beliefs cost one failed
    # load, which falls back to recomputing.
    stored: Map
    storing: Map  # hash -> id of the store job writing it, so it is not planned twice
    loading: Map  # request id -> its load job id, while the request waits for it
    # request id -> (its ended LoadJob, ok): the load ended and the request, still holding the
    # blocks, waits for the scheduler to take it up (vLLM's finished_recving_kv_req_ids).
    arrived: Map
    # Requests that left the waiting queue to load KV, in the order the scheduler takes them up
    # (vLLM's kv_holding_waiting): loading, arrived, or taken up but not yet admitted.
    holding: tuple[str, ...]
    # request id -> how many leading blocks of its table were already offered to plan_store.
    store_cursor: Map
    stats: OffloadStats


def make_kv_jobs() -> KVJobs:
    empty = Map()
    return KVJobs(
        next_job_id=1,
        in_flight=empty,
        stored=empty,
        storing=empty,
        loading=empty,
        arrived=empty,
        holding=(),
        store_cursor=empty,
        stats=OffloadStats(),
    )


# ---------------------------------------------------------------- queries


def has_jobs_in_flight(jobs: KVJobs) -> bool:
    return bool(jobs.in_flight)


def pins(jobs: KVJobs) -> Counter:
    """Block id -> references held by in-flight jobs (for invariant checks)."""
    held: Counter = Counter()
    for job in jobs.in_flight.values():
        held.update(job.block_ids)
    return held


def stored_run(jobs: KVJobs, block_hashes: Sequence[BlockHash], start: int, stop: int) -> int:
    """How many of block_hashes[start:stop] the store holds in a row, from `start`."""
    count = 0
    for position in range(start, min(stop, len(block_hashes))):
        if block_hashes[position] not in jobs.stored or block_hashes[position] in jobs.storing:
            break
        count += 1
    return count


# ---------------------------------------------------------------- transitions


def plan_store(
    jobs: KVJobs,
    kv: KVCache,
    req_id: str,
    block_ids: Sequence[int],
    block_hashes: Sequence[BlockHash],
) -> tuple[KVJobs, KVCache, StoreJob | None]:
    """A job storing those blocks whose hash is neither stored nor being stored; None if none."""
    block_ids, block_hashes = tuple(block_ids), tuple(block_hashes)
    if len(block_ids) != len(block_hashes):
        raise KVJobError(
            f"plan_store({req_id!r}): {len(block_ids)} blocks but {len(block_hashes)} hashes"
        )
    chosen_ids, chosen_hashes, seen = [], [], set()
    for block, block_hash in zip(block_ids, block_hashes, strict=True):
        if bp.ref_count(kv.pool, block) == 0:
            raise KVJobError(f"plan_store({req_id!r}): block {block} is free; nothing to read")
        if bp.block_hash_of(kv.pool, block) != block_hash:
            raise KVJobError(
                f"plan_store({req_id!r}): block {block} is not registered under hash "
                f"{block_hash.hex()[:16]}.. (only full, hashed blocks are stored)"
            )
        if block_hash in jobs.stored or block_hash in jobs.storing or block_hash in seen:
            continue
        seen.add(block_hash)
        chosen_ids.append(block)
        chosen_hashes.append(block_hash)
    if not chosen_ids:
        return jobs, kv, None
    job = StoreJob(jobs.next_job_id, req_id, tuple(chosen_ids), tuple(chosen_hashes))
    storing = jobs.storing.mutate()
    for block_hash in job.block_hashes:
        storing[block_hash] = job.job_id
    jobs = replace(
        jobs,
        next_job_id=job.job_id + 1,
        in_flight=jobs.in_flight.set(job.job_id, job),
        storing=storing.finish(),
    )
    return jobs, kvc.pin(kv, job.block_ids), job


def plan_load(
    jobs: KVJobs,
    kv: KVCache,
    req_id: str,
    block_ids: Sequence[int],
    block_hashes: Sequence[BlockHash],
    first_token: int,
) -> tuple[KVJobs, KVCache, LoadJob]:
    """A job writing the stored blocks `block_hashes` into the request's `block_ids`."""
    block_ids, block_hashes = tuple(block_ids), tuple(block_hashes)
    if not block_ids or len(block_ids) != len(block_hashes):
        raise KVJobError(
            f"plan_load({req_id!r}): {len(block_ids)} blocks and {len(block_hashes)} hashes; "
            "expected as many of each, at least one"
        )
    if req_id in jobs.loading:
        raise KVJobError(
            f"plan_load({req_id!r}): load job {jobs.loading[req_id]} is still writing its blocks"
        )
    if isinstance(first_token, bool) or not isinstance(first_token, int) or first_token < 0:
        raise KVJobError(f"plan_load({req_id!r}): first_token={first_token!r}, expected >= 0")
    for block in block_ids:
        if bp.ref_count(kv.pool, block) == 0:
            raise KVJobError(f"plan_load({req_id!r}): block {block} is free; nobody owns it")
        if bp.block_hash_of(kv.pool, block) is not None:
            raise KVJobError(
                f"plan_load({req_id!r}): block {block} is already a cached prefix block; "
                "a load writes only blocks not yet registered"
            )
    job = LoadJob(jobs.next_job_id, req_id, block_ids, block_hashes, first_token)
    jobs = replace(
        jobs,
        next_job_id=job.job_id + 1,
        in_flight=jobs.in_flight.set(job.job_id, job),
        loading=jobs.loading.set(req_id, job.job_id),
    )
    return jobs, kvc.pin(kv, block_ids), job


def complete_job(
    jobs: KVJobs, kv: KVCache, job_id: int, evicted: Iterable[BlockHash] = ()
) -> tuple[KVJobs, KVCache, KVJob]:
    return end_job(jobs, kv, KVJobResult(job_id, True, tuple(evicted)))


def fail_job(jobs: KVJobs, kv: KVCache, job_id: int) -> tuple[KVJobs, KVCache, KVJob]:
    return end_job(jobs, kv, KVJobResult(job_id, False))


def end_job(jobs: KVJobs, kv: KVCache, result: KVJobResult) -> tuple[KVJobs, KVCache, KVJob]:
    """Apply one job's end: release its pins tail-first and record what the store now holds.

    Whether a finished load still belongs to a waiting request is `jobs.loading[job.req_id] ==
    job.job_id` *before* this call; the caller (the scheduler) checks it.
    """
    job = jobs.in_flight.get(result.job_id)
    if job is None:
        state = "already ended" if 0 < result.job_id < jobs.next_job_id else "was never planned"
        raise KVJobError(f"KV job {result.job_id!r} {state}; each job ends exactly once")
    stats, stored, storing, loading = jobs.stats, jobs.stored, jobs.storing, jobs.loading
    n = len(job.block_ids)
    if isinstance(job, StoreJob):
        storing_m, stored_m = storing.mutate(), stored.mutate()
        for block_hash in job.block_hashes:
            del storing_m[block_hash]
            if result.ok:
                stored_m[block_hash] = True
        storing, stored = storing_m.finish(), stored_m.finish()
        if result.ok:
            stats = replace(stats, blocks_stored=stats.blocks_stored + n)
        else:
            stats = replace(stats, store_failures=stats.store_failures + 1)
    else:
        if loading.get(job.req_id) == job.job_id:
            loading = loading.delete(job.req_id)
        if result.ok:
            stats = replace(
                stats,
                blocks_loaded=stats.blocks_loaded + n,
                hit_tokens=stats.hit_tokens + n * kv.pool.block_size,
            )
        else:
            # Do not plan the same load again; the tokens are recomputed instead.
            stored = _forget(stored, job.block_hashes)
            stats = replace(stats, load_failures=stats.load_failures + 1)
    stored = _forget(stored, result.evicted)
    jobs = replace(
        jobs,
        in_flight=jobs.in_flight.delete(job.job_id),
        stored=stored,
        storing=storing,
        loading=loading,
        stats=stats,
    )
    return jobs, kvc.unpin(kv, tuple(reversed(job.block_ids))), job


def detach_request(jobs: KVJobs, req_id: str) -> KVJobs:
    """The request finished or was preempted: its jobs keep their pins, but a load no longer
    feeds it and its store cursor is dropped, so a later request with the same id starts afresh."""
    loading, arrived, cursor = jobs.loading, jobs.arrived, jobs.store_cursor
    if req_id not in loading and req_id not in cursor and req_id not in jobs.holding:
        return jobs
    return replace(
        jobs,
        loading=loading.delete(req_id) if req_id in loading else loading,
        arrived=arrived.delete(req_id) if req_id in arrived else arrived,
        holding=tuple(r for r in jobs.holding if r != req_id),
        store_cursor=cursor.delete(req_id) if req_id in cursor else cursor,
    )


def note_stored(jobs: KVJobs, block_hashes: Iterable[BlockHash]) -> KVJobs:
    """Record hashes the shell found in the store (e.g. stored by another engine)."""
    fresh = [h for h in block_hashes if h not in jobs.stored]
    if not fresh:
        return jobs
    stored = jobs.stored.mutate()
    for block_hash in fresh:
        stored[block_hash] = True
    return replace(jobs, stored=stored.finish())


def forget_stored(jobs: KVJobs, block_hashes: Iterable[BlockHash]) -> KVJobs:
    stored = _forget(jobs.stored, block_hashes)
    return jobs if stored is jobs.stored else replace(jobs, stored=stored)


def _forget(stored: Map, block_hashes: Iterable[BlockHash]) -> Map:
    block_hashes = [h for h in block_hashes if h in stored]
    if not block_hashes:
        return stored
    stored_m = stored.mutate()
    for block_hash in block_hashes:
        del stored_m[block_hash]
    return stored_m.finish()
