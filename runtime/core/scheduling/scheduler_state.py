"""SchedulerState: the whole scheduler as one immutable value, and small helpers over it.

Fields are independent so an owner can add its own (e.g. KV jobs that pin blocks) without touching
the others. Requests that finished are dropped from `requests` at once (a finished request holds
nothing), so a request id can be reused by a later request.
"""

from bisect import insort
from dataclasses import dataclass, replace

from immutables import Map

from runtime.core.encoder import encoder_cache as ec
from runtime.core.encoder.encoder_cache import EncoderCache, make_encoder_cache
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs.jobs import KVJobs
from runtime.core.request import Request
from runtime.core.scheduling.scheduler_config import SchedulerConfig
from runtime.core.state.state_slots import StateSlots, make_state_slots

__all__ = [
    "SchedulerError",
    "SchedulerState",
    "evolve_state",
    "hash_extras",
    "make_scheduler",
    "priority_key",
    "release_request_inputs",
    "with_waiting",
]


class SchedulerError(ValueError):
    """Misuse of the scheduler (unknown request, stale step output...); the state is unchanged."""


@dataclass(frozen=True, slots=True, repr=False)
class SchedulerState:
    config: SchedulerConfig
    kv: kvc.KVCache
    encoder: EncoderCache
    # Unfinished requests by id.
    requests: Map
    # Ids in admission order (FCFS: arrival, preempted ones in front; priority: priority_key).
    waiting: tuple[str, ...]
    # Ids in the order they were admitted; FCFS preempts from the end.
    running: tuple[str, ...]
    # The step number the next schedule() will give its output.
    step: int
    # Finished or aborted since the last schedule(); reported to the runner by the next one.
    finished_since_last: tuple[str, ...]
    # The oldest step whose schedule() output has not been applied by update(), if any (async
    # scheduling: steps awaiting_update .. step - 1 are in flight, at most two).
    awaiting_update: int | None
    # KV store/load jobs (runtime/core/kv_jobs/scheduler_hooks.py); None when no KV store is used.
    kv_jobs: KVJobs | None = None
    # Recurrent-state slots, held by exactly the running requests; None when the model keeps no
    # per-request state (config.num_state_slots == 0).
    state_slots: StateSlots | None = None
    # Async scheduling: request id -> its scheduled steps not yet applied by update(), oldest
    # first (runtime/core/scheduling/in_flight.py). Always empty with synchronous scheduling.
    in_flight: Map = Map()

    def __repr__(self) -> str:
        return (
            f"SchedulerState(step={self.step}, running={len(self.running)}, "
            f"waiting={len(self.waiting)}, free_blocks={kvc.num_free_blocks(self.kv)}, "
            f"awaiting_update={self.awaiting_update})"
        )


def make_scheduler(config: SchedulerConfig) -> SchedulerState:
    if not isinstance(config, SchedulerConfig):
        raise SchedulerError(f"make_scheduler: config={config!r}, expected a SchedulerConfig")
    return SchedulerState(
        config=config,
        kv=kvc.make_kv_cache(
            config.num_blocks,
            config.block_size,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
        ),
        encoder=make_encoder_cache(config.encoder_cache_size),
        requests=Map(),
        waiting=(),
        running=(),
        step=0,
        finished_since_last=(),
        awaiting_update=None,
        state_slots=make_state_slots(config.num_state_slots) if config.num_state_slots else None,
    )


def evolve_state(state: SchedulerState, **changes) -> SchedulerState:
    """`state` with the named fields changed and every other field carried over: every transition
    rebuilds the state through here, so a new field is one edit (the class and `make_scheduler`)."""
    return replace(state, **changes)


def priority_key(request: Request) -> tuple:
    """vLLM's priority order: more urgent (lower) priority, then earlier arrival, then id."""
    return (request.priority, request.arrival_time, request.request_id)


def with_waiting(
    waiting: tuple[str, ...], requests: Map, request_id: str, policy: str, *, front: bool
) -> tuple[str, ...]:
    """`waiting` with `request_id` queued: FCFS at the back, or at the front (a preempted
    request); priority in `priority_key` order."""
    if policy == "fcfs":
        return (request_id, *waiting) if front else (*waiting, request_id)
    queue = list(waiting)
    insort(queue, request_id, key=lambda rid: priority_key(requests[rid]))
    return tuple(queue)


def hash_extras(request: Request) -> kvc.HashExtras:
    if not (request.mm_inputs or request.lora_name or request.cache_salt):
        return _NO_EXTRAS
    return kvc.HashExtras(
        mm_spans=tuple((m.content_hash, m.offset, m.num_embeds) for m in request.mm_inputs),
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
    )


_NO_EXTRAS = kvc.HashExtras()


def release_request_inputs(
    encoder: EncoderCache, request: Request, *, upto: int | None = None
) -> EncoderCache:
    """Drop the request's references (only those of inputs ending at or before `upto`)."""
    if not request.mm_inputs:
        return encoder
    held = []
    for position, item in enumerate(request.mm_inputs):
        if upto is not None and item.end > upto:
            break
        entry = encoder.entries.get(item.content_hash)
        owner = (request.request_id, position)
        if entry is not None and owner in entry.refs:
            held.append((item.content_hash, owner))
    return ec.release(encoder, held) if held else encoder
