"""schedule(state) -> (state, SchedulerOutput): one step's decisions, with vLLM V1 semantics.

One rule for every request: give it tokens until its computed count catches up with the tokens it
has (chunked prefill, decode and prefix hits alike). Running requests first, in admission order;
when blocks run out, preempt by recompute (FCFS: the last admitted; priority: the least urgent,
which may be the request itself, and then the loop goes on with the next one). Waiting requests
next, head of the queue first, and only if nothing was preempted this step.

Hybrid models (config.num_state_slots > 0): a request is admitted only with a free
recurrent-state slot besides its blocks, and holds it while it runs; a preempted request gives
it back (its state is rebuilt by recompute from token 0). The output names each scheduled
request's slot and the slots whose new owner starts this step (to be zeroed first).

`num_computed_tokens` of the returned state is still the count before this step; `update` adds
the scheduled tokens once the runner has computed them.

Async scheduling (config.async_scheduling, vLLM's AsyncScheduler): the next step may be planned
while one step is in flight. A request with steps in flight is planned as if they had been
applied, its sampled tokens as placeholders (runtime/core/scheduling/in_flight.py); one whose
in-flight step already reaches max_tokens or max_model_len is passed over.
"""

from dataclasses import replace

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs.scheduler_hooks import (
    blocks_to_finish,
    plan_stores,
    start_load,
    stored_beyond,
    take_up_load,
)
from runtime.core.outputs import SchedulerOutput
from runtime.core.request import Request, RequestStatus, evolve
from runtime.core.scheduling.assemble_output import assemble_output
from runtime.core.scheduling.encoder_scheduling import plan_encoder_inputs, take_encoder_inputs
from runtime.core.scheduling.in_flight import ahead, mark_stale
from runtime.core.scheduling.scheduler_state import (
    SchedulerError,
    SchedulerState,
    priority_key,
    release_request_inputs,
    with_waiting,
)
from runtime.core.state import state_slots as ss

__all__ = ["schedule"]


class _Step:
    """Scratch accumulator of one schedule() call. It never escapes the call: the call's input
    state is never modified and its outputs are fresh immutable values."""

    __slots__ = (
        "admitted",
        "base",
        "changed",
        "computed",
        "config",
        "encoder",
        "encoder_budget",
        "in_flight",
        "jobs",
        "kv",
        "loads",
        "new_blocks",
        "num_scheduled",
        "preempted",
        "running",
        "slots",
        "threshold",
        "token_budget",
        "waiting",
    )

    def __init__(self, state: SchedulerState) -> None:
        self.config = state.config
        self.kv = state.kv
        self.encoder = state.encoder
        self.base = state.requests
        self.changed: dict[str, Request] = {}
        self.running = list(state.running)
        self.waiting = state.waiting
        # KV jobs (None without a KV store) and the loads started this step.
        self.jobs = state.kv_jobs
        self.loads: list = []
        # Recurrent-state slots (None: the model keeps no per-request state).
        self.slots = state.state_slots
        self.token_budget = state.config.max_num_batched_tokens
        # The long-prefill cap keeps one prefill from starving the others; with a single
        # request there is nobody to starve (vLLM lifts it then too; requests holding blocks
        # for a KV load count as waiting there).
        holding = state.kv_jobs.holding if state.kv_jobs is not None else ()
        many = len(state.running) + len(state.waiting) + len(holding) > 1
        self.threshold = state.config.long_prefill_token_threshold if many else 0
        self.encoder_budget = state.config.encoder_compute_budget
        # Running requests scheduled this step, in order: tokens and freshly appended blocks.
        self.num_scheduled: dict[str, int] = {}
        self.new_blocks: dict[str, tuple[int, ...]] = {}
        # Requests admitted from the waiting queue: (id, resumed from preemption, tokens).
        self.admitted: list[tuple[str, bool, int]] = []
        self.preempted: list[str] = []
        # Async scheduling: steps in flight by request, and for each running request planned,
        # (computed tokens counting them, placeholders). None with synchronous scheduling.
        self.in_flight = state.in_flight if state.config.async_scheduling else None
        self.computed: dict[str, tuple[int, int]] = {}

    def get(self, request_id: str) -> Request:
        request = self.changed.get(request_id)
        return self.base[request_id] if request is None else request


def schedule(state: SchedulerState) -> tuple[SchedulerState, SchedulerOutput]:
    if state.config.async_scheduling:
        if state.awaiting_update is not None and state.step - state.awaiting_update > 1:
            raise SchedulerError(
                f"schedule: steps {state.awaiting_update}..{state.step - 1} are in flight; with "
                f"async scheduling one step may be in flight, so apply step "
                f"{state.awaiting_update} with update() first"
            )
    elif state.awaiting_update is not None:
        raise SchedulerError(
            f"schedule: the output of step {state.awaiting_update} has not been applied; call "
            "update() with it (and the runner's output) before scheduling the next step"
        )
    step = _Step(state)
    _schedule_running(step)
    if not step.preempted:
        _schedule_waiting(step)
    return plan_stores(*assemble_output(state, step), tuple(step.loads))


def _num_new_tokens(step: _Step, request: Request, num_computed: int) -> int:
    num_new = request.num_tokens - num_computed
    threshold = step.threshold
    if 0 < threshold < num_new:
        num_new = threshold
    return num_new


def _schedule_running(step: _Step) -> None:
    # The hot loop of a step (every running request, every step): attributes read once.
    running, changed, base = step.running, step.changed, step.base
    num_scheduled, new_blocks_of = step.num_scheduled, step.new_blocks
    threshold = step.threshold
    in_flight = step.in_flight
    index = 0
    while index < len(running) and step.token_budget > 0:
        request_id = running[index]
        request = changed.get(request_id) or base[request_id]
        computed = request.num_computed_tokens
        num_new = len(request.prompt_token_ids) + len(request.output_token_ids) - computed
        if in_flight is not None:
            num_new = _num_new_async(step, request, computed, num_new)
            if num_new == 0:
                index += 1
                continue
            computed = step.computed[request_id][0]
        if 0 < threshold < num_new:
            num_new = threshold
        num_new = min(num_new, step.token_budget)
        if request.mm_inputs:
            encoder, taken, num_new, encoder_budget = plan_encoder_inputs(
                step.encoder, step.encoder_budget, request, computed, num_new
            )
            if num_new == 0:
                index += 1
                continue
        encoder_before = step.encoder
        if _fits_as_is(step.kv, request_id, num_new, request, computed):
            new_blocks = ()
        else:
            new_blocks, index = _allocate_or_preempt(step, index, request, num_new, computed)
            if new_blocks is None:
                # It preempted itself. FCFS: it was the last running request, so nothing is
                # left. Priority: it was the lowest-priority one; the requests after it may
                # still fit in the blocks it freed, and `index` already names the next one
                # (vLLM's running loop goes on the same way).
                if step.config.policy == "priority":
                    continue
                break
        num_scheduled[request_id] = num_new
        new_blocks_of[request_id] = new_blocks
        step.token_budget -= num_new
        if request.mm_inputs:
            step.encoder = take_encoder_inputs(
                step.encoder, request, encoder, encoder_before, taken
            )
            step.encoder_budget = encoder_budget
        index += 1


def _num_new_async(step: _Step, request: Request, computed: int, num_new: int) -> int:
    """Async scheduling: the tokens a running request still needs when its steps in flight are
    counted as computed and their sampled tokens as placeholders (vLLM's AsyncScheduler); 0
    when the steps in flight already take it to max_tokens or max_model_len. Notes the computed
    count that includes the steps in flight in `step.computed`."""
    request_id = request.request_id
    entries = step.in_flight.get(request_id)
    placeholders = 0
    if entries:
        tokens, placeholders = ahead(entries)
        computed += tokens
        num_new += placeholders - tokens
    step.computed[request_id] = (computed, placeholders)
    max_tokens = request.sampling_params.max_tokens
    if (
        placeholders
        and max_tokens is not None
        and computed + 2 - placeholders >= len(request.prompt_token_ids) + max_tokens
    ):
        return 0
    # A pooling request samples nothing, so it needs no room for a sampled token.
    room = step.config.max_model_len - computed - (request.pooling_params is None)
    return max(0, min(num_new, room))


def _allocate_or_preempt(
    step: _Step, index: int, request: Request, num_new: int, computed: int
) -> tuple[tuple[int, ...] | None, int]:
    """Allocate slots for a running request, preempting others (or itself) until it fits.

    Returns the freshly appended block ids (None if the request itself was preempted, having
    left `running`) and the loop index, moved back when an earlier request was preempted.
    """
    request_id = request.request_id
    while True:
        result = kvc.allocate_slots(
            step.kv,
            request_id,
            num_new,
            computed,
            block_hashes=request.block_hashes,
        )
        if isinstance(result, kvc.Allocated):
            step.kv = result.state
            return result.new_block_ids, index
        position = _victim_position(step)
        victim = step.running.pop(position)
        if victim in step.num_scheduled:
            step.token_budget += step.num_scheduled.pop(victim)
            del step.new_blocks[victim]
        if position < index:
            index -= 1
        _preempt(step, victim)
        if victim == request_id:
            return None, index


def _fits_as_is(
    kv: kvc.KVCache, request_id: str, num_new: int, request: Request, computed: int
) -> bool:
    """Whether `allocate_slots` would change nothing: no new block is needed and no block
    becomes full and cacheable. Most decode steps are such, and skipping the call keeps a step's
    cost proportional to the requests whose blocks change."""
    table = kv.tables.get(request_id)
    if table is None:
        return False
    filled = computed + num_new
    block_size = kv.pool.block_size
    if filled > len(table) * block_size or filled > kv.max_model_len:
        return False
    if not kv.enable_prefix_caching or not request.block_hashes:
        return True
    num_full = min(filled // block_size, len(request.block_hashes), len(table))
    return num_full <= kv.num_cached.get(request_id, 0)


def _victim_position(step: _Step) -> int:
    """FCFS: the last admitted (vLLM's running.pop()); priority: the largest
    (priority, arrival), the first such in admission order on ties."""
    if step.config.policy == "fcfs":
        return len(step.running) - 1
    keys = [priority_key(step.get(rid))[:2] for rid in step.running]
    return keys.index(max(keys))


def _preempt(step: _Step, request_id: str) -> None:
    request = step.get(request_id)
    step.kv = kvc.free(step.kv, request_id)
    if step.slots is not None:
        step.slots = ss.release(step.slots, request_id)
    step.encoder = release_request_inputs(step.encoder, request)
    step.changed[request_id] = evolve(
        request,
        status=RequestStatus.PREEMPTED,
        num_computed_tokens=0,
        num_preemptions=request.num_preemptions + 1,
    )
    step.waiting = with_waiting(step.waiting, step.base, request_id, step.config.policy, front=True)
    step.preempted.append(request_id)
    if step.in_flight is not None:
        # Its steps in flight still deliver their tokens, but no longer count as computed.
        step.computed.pop(request_id, None)
        entries = step.in_flight.get(request_id)
        if entries:
            step.in_flight = step.in_flight.set(request_id, mark_stale(entries))


# What _admit did with a request taken from a queue.
_ADMITTED, _PASSED, _LOADING, _STOP = "admitted", "passed", "loading", "stop"


def _schedule_waiting(step: _Step) -> None:
    """vLLM's waiting loop. With a KV store, the requests that left the waiting queue to load KV
    (`kv_jobs.holding`, vLLM's kv_holding_waiting) are taken up first, in order: one still
    loading keeps its place, one whose load arrived is admitted with what the load brought.
    Then the waiting queue, head first. Neither kind of request counts against max_num_seqs
    before it is admitted."""
    config = step.config
    holding = step.jobs.holding if step.jobs is not None else ()
    waiting = step.waiting
    next_holding = next_waiting = 0
    # Requests that keep their place at the head of their queue this step: still loading, just
    # started a load (they join `holding`), or passed over (an encoder input they need cannot
    # run yet, so they do not stall the requests behind them).
    kept: list[str] = []
    passed: list[str] = []
    while step.token_budget > 0 and len(step.running) < config.max_num_seqs:
        if step.slots is not None and not step.slots.free:
            # Every state slot is held by a running request: like a full batch, nobody else
            # can be admitted (or start a KV load) this step.
            break
        if next_holding < len(holding):
            request_id = holding[next_holding]
            next_holding += 1
            if request_id in step.jobs.loading:
                kept.append(request_id)
                continue
            request = step.get(request_id)
            if request_id in step.jobs.arrived:
                step.jobs, step.kv, request = take_up_load(step.jobs, step.kv, request)
                step.changed[request_id] = request
            outcome = _admit(step, request, (*kept, *holding[next_holding:]))
            if outcome is _STOP:
                next_holding -= 1
                break
            if outcome is not _ADMITTED:
                kept.append(request_id)
        elif next_waiting < len(waiting):
            request_id = waiting[next_waiting]
            next_waiting += 1
            outcome = _admit(step, step.get(request_id), kept)
            if outcome is _STOP:
                next_waiting -= 1
                break
            if outcome is _PASSED:
                passed.append(request_id)
            elif outcome is _LOADING:
                kept.append(request_id)
        else:
            break
    if passed or next_waiting:
        step.waiting = (*passed, *waiting[next_waiting:])
    if kept or next_holding:
        queue = (*kept, *holding[next_holding:])
        if config.policy == "priority":
            queue = tuple(sorted(queue, key=lambda rid: priority_key(step.get(rid))))
        step.jobs = replace(step.jobs, holding=queue)


def _admit(step: _Step, request: Request, holding: tuple[str, ...] | list[str]) -> str:
    """Admit one request taken from a queue, or start its KV load, or pass it over; _STOP when
    it does not fit (vLLM stops the whole loop then). `holding`: the other requests holding or
    loading blocks, whose remaining blocks a load must leave free."""
    config = step.config
    request_id = request.request_id
    held = step.kv.tables.get(request_id)
    if held is not None:
        # It holds the blocks its load brought (vLLM: num_computed_tokens > 0 while waiting).
        prefix = kvc.NO_PREFIX
        computed = request.num_computed_tokens
    else:
        # A request asking for prompt logprobs computes every prompt position (vLLM's
        # skip_reading_prefix_cache): no prefix-cache hit, no load; its full blocks are still
        # cached as they fill.
        skip = request.skip_reading_prefix_cache
        prefix = kvc.NO_PREFIX if skip else kvc.find_cached_prefix(step.kv, request)
        computed = prefix.num_tokens
        if step.jobs is not None and not skip:
            num_remote = stored_beyond(step.jobs, request, prefix, config.block_size)
            if num_remote:
                return _load(step, request, prefix, num_remote, holding)
    num_new = _num_new_tokens(step, request, computed)
    if not config.enable_chunked_prefill and num_new > step.token_budget:
        return _STOP
    num_new = min(num_new, step.token_budget)
    encoder, taken, num_new, encoder_budget = plan_encoder_inputs(
        step.encoder, step.encoder_budget, request, computed, num_new
    )
    if num_new == 0:
        return _PASSED
    if config.reserve_full_sequence and not _whole_sequence_fits(step.kv, request, prefix):
        return _STOP
    result = kvc.allocate_slots(
        step.kv,
        request_id,
        num_new,
        computed if held is not None else 0,
        prefix.blocks,
        block_hashes=request.block_hashes,
    )
    if not isinstance(result, kvc.Allocated):
        return _STOP
    step.kv = result.state
    if step.slots is not None:
        step.slots, _ = ss.take(step.slots, request_id)
    step.running.append(request_id)
    step.changed[request_id] = evolve(
        request, status=RequestStatus.RUNNING, num_computed_tokens=computed
    )
    step.admitted.append((request_id, request.status is RequestStatus.PREEMPTED, num_new))
    step.token_budget -= num_new
    step.encoder, step.encoder_budget = encoder, encoder_budget
    return _ADMITTED


def _load(
    step: _Step,
    request: Request,
    prefix: kvc.CachedPrefix,
    num_remote: int,
    holding: tuple[str, ...] | list[str],
) -> str:
    """vLLM's async-load admission: the whole sequence must fit the free blocks (as any
    admission), and the blocks the load takes now must leave free what the requests already
    prefilling or loading still need."""
    if step.config.reserve_full_sequence and not _whole_sequence_fits(step.kv, request, prefix):
        return _STOP
    kv = step.kv
    reserved = sum(blocks_to_finish(kv, step.get(rid)) for rid in step.running) + sum(
        blocks_to_finish(kv, step.get(rid)) for rid in holding
    )
    started = start_load(step.jobs, kv, request, prefix, num_remote, reserved)
    if started is None:
        return _STOP
    step.jobs, step.kv, job = started
    step.changed[request.request_id] = evolve(request, status=RequestStatus.WAITING_FOR_REMOTE_KV)
    step.loads.append(job)
    return _LOADING


def _whole_sequence_fits(kv: kvc.KVCache, request: Request, prefix: kvc.CachedPrefix) -> bool:
    """vLLM's admission check (scheduler_reserve_full_isl): every token the request has must
    fit in the free blocks, not only this step's chunk, so that admitting it does not soon
    force a preemption. A prefix-hit block that is free leaves the free list when touched;
    blocks it holds already (after a KV load) count as its own."""
    pool = kv.pool
    block_size = pool.block_size
    num_tokens = min(request.num_tokens, kv.max_model_len)
    revived = sum(1 for block in prefix.blocks if bp.ref_count(pool, block) == 0)
    held = len(kv.tables.get(request.request_id, ()))
    needed = -(-num_tokens // block_size) - len(prefix.blocks) - held + revived
    return needed <= kvc.num_free_blocks(kv)
