"""Whole-state invariants of the scheduler (ARCHITECTURE.md), for property tests and notebooks.

O(state): never called by the engine loop.
"""

from runtime.core.encoder import encoder_cache as ec
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj
from runtime.core.outputs import SchedulerOutput
from runtime.core.request import RequestStatus
from runtime.core.scheduling.in_flight import ahead
from runtime.core.scheduling.scheduler_state import SchedulerState, hash_extras, priority_key
from runtime.core.state import state_slots as ss

__all__ = ["check_output", "check_state"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def check_state(state: SchedulerState) -> None:
    """Raise AssertionError naming the first broken invariant of `state`."""
    config = state.config
    # Requests that left the waiting queue for a KV load sit in `kv_jobs.holding`
    # (kv_jobs/scheduler_hooks.py).
    jobs = state.kv_jobs
    holding = jobs.holding if jobs is not None else ()
    kvc.check_invariants(state.kv, extra_holders=kj.pins(jobs) if jobs is not None else ())
    ec.check_invariants(state.encoder)
    waiting, running = state.waiting, state.running
    _require(len(set(waiting)) == len(waiting), f"waiting repeats ids: {waiting}")
    _require(len(set(running)) == len(running), f"running repeats ids: {running}")
    _require(not set(waiting) & set(running), f"ids both waiting and running: {waiting} {running}")
    _require(len(set(holding)) == len(holding), f"holding repeats ids: {holding}")
    _require(
        not set(holding) & (set(waiting) | set(running)),
        f"ids both holding and queued: {holding} {waiting} {running}",
    )
    queued = set(waiting) | set(running) | set(holding)
    _require(
        queued == set(state.requests),
        f"queued ids {sorted(queued)} != requests {sorted(state.requests)}",
    )
    _require(len(running) <= config.max_num_seqs, f"{len(running)} running > max_num_seqs")
    holders = set(running) | {rid for rid in holding if kvc.has_request(state.kv, rid)}
    _require(
        set(state.kv.tables) == holders,
        f"block tables {sorted(state.kv.tables)} != running and holding {sorted(holders)}",
    )
    if jobs is not None:
        _check_holding(state)
    _check_state_slots(state)
    for request_id in waiting:
        request = state.requests[request_id]
        _require(
            request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and request.num_computed_tokens == 0,
            f"waiting {request_id!r}: status {request.status.name}, "
            f"{request.num_computed_tokens} computed",
        )
    if config.policy == "priority":
        keys = [priority_key(state.requests[rid]) for rid in waiting]
        _require(keys == sorted(keys), f"priority waiting queue out of order: {waiting}")
    for request_id in running:
        request = state.requests[request_id]
        _require(
            request.status is RequestStatus.RUNNING, f"running {request_id!r} is {request.status}"
        )
        table = kvc.blocks_of(state.kv, request_id)
        _require(
            request.num_computed_tokens <= min(request.num_tokens, len(table) * config.block_size),
            f"running {request_id!r}: {request.num_computed_tokens} computed, "
            f"{request.num_tokens} tokens, {len(table)} blocks",
        )
    for request in state.requests.values():
        _require(request.finish_reason is None, f"finished {request.request_id!r} is still held")
        if config.enable_prefix_caching:
            expected = kvc.extend_block_hashes(
                (), request.all_token_ids, config.block_size, hash_extras(request)
            )
            _require(
                request.block_hashes == expected,
                f"{request.request_id!r}: {len(request.block_hashes)} block hashes for "
                f"{request.num_tokens} tokens, not the hash chain of its tokens",
            )
    for content_hash, entry in state.encoder.entries.items():
        for request_id, position in entry.refs:
            request = state.requests.get(request_id)
            _require(
                request is not None
                and request_id in running
                and request.mm_inputs[position].content_hash == content_hash,
                f"encoder entry {content_hash!r} referenced by {(request_id, position)}, which is "
                "not a running request's input with that hash",
            )


def _check_state_slots(state: SchedulerState) -> None:
    """Hybrid models: owned slots are disjoint, free + owned = all slots, and the owners are
    exactly the running requests (waiting, preempted and holding ones hold none)."""
    slots, num_slots = state.state_slots, state.config.num_state_slots
    if not num_slots:
        _require(slots is None, f"state slots {slots} without config.num_state_slots")
        return
    _require(
        slots is not None and slots.num_slots == num_slots,
        f"state slots {slots}, expected a pool of config.num_state_slots={num_slots}",
    )
    ss.check_invariants(slots)
    _require(
        set(slots.owners) == set(state.running),
        f"state slot owners {sorted(slots.owners)} != running {sorted(state.running)}",
    )


def _check_holding(state: SchedulerState) -> None:
    """Requests holding blocks for a KV load: loading, arrived, or taken up and not yet admitted
    (then holding the loaded blocks as cached and computed), or dropped after a failed load."""
    jobs, kv, block_size = state.kv_jobs, state.kv, state.config.block_size
    loading, arrived = set(jobs.loading), set(jobs.arrived)
    _require(
        loading | arrived <= set(jobs.holding) and not loading & arrived,
        f"loading {sorted(loading)} and arrived {sorted(arrived)}: not disjoint parts of holding",
    )
    for request_id in jobs.holding:
        request = state.requests[request_id]
        table = kv.tables.get(request_id)
        job = jobs.in_flight.get(jobs.loading[request_id]) if request_id in loading else None
        if request_id in arrived:
            job = jobs.arrived[request_id][0]
        if job is not None:
            # A loaded request keeps the blocks its load writes until the scheduler takes it up.
            first = job.first_token // block_size
            _require(
                request.status is RequestStatus.WAITING_FOR_REMOTE_KV
                and request.num_computed_tokens == 0
                and table is not None
                and table[first:] == job.block_ids
                and kv.num_cached[request_id] == first,
                f"holding {request_id!r} ({request.status.name}): table {table} does not end "
                f"with the unregistered blocks {job.block_ids} of its load {job.job_id}",
            )
            continue
        _require(
            request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and (table is not None) == (request.num_computed_tokens > 0),
            f"holding {request_id!r}: status {request.status.name}, "
            f"{request.num_computed_tokens} computed, table {table}",
        )
        if table is not None:
            _require(
                request.num_computed_tokens == len(table) * block_size <= request.num_tokens - 1
                and kv.num_cached[request_id] == len(table),
                f"holding {request_id!r}: {request.num_computed_tokens} computed of "
                f"{request.num_tokens} tokens but {len(table)} loaded cached blocks",
            )
    if state.config.policy == "priority":
        keys = [priority_key(state.requests[rid]) for rid in jobs.holding]
        _require(keys == sorted(keys), f"priority holding queue out of order: {jobs.holding}")


def check_output(before: SchedulerState, after: SchedulerState, output: SchedulerOutput) -> None:
    """Invariants of one schedule() output, given the states before and after it."""
    config = before.config
    scheduled = output.num_scheduled_tokens
    _require(
        output.total_num_scheduled_tokens
        == sum(scheduled.values())
        <= config.max_num_batched_tokens,
        f"{output.total_num_scheduled_tokens} tokens scheduled, budget {config.max_num_batched_tokens}",
    )
    _require(len(scheduled) <= config.max_num_seqs, f"{len(scheduled)} requests > max_num_seqs")
    order = tuple(c.req_id for c in output.scheduled_cached_reqs) + tuple(
        n.req_id for n in output.scheduled_new_reqs
    )
    _require(
        order == tuple(scheduled), f"batch order {order} != token map order {tuple(scheduled)}"
    )
    span = _positions(after, output)
    for request_id, num_tokens in scheduled.items():
        start, total = span[request_id]
        _require(
            num_tokens >= 1 and start + num_tokens <= total,
            f"{request_id!r}: {num_tokens} scheduled after {start} computed of {total} (tokens "
            "and placeholders of steps in flight)",
        )
        _require(start <= total - 1, f"{request_id!r}: prefix hit leaves nothing to compute")
        # The cap is lifted when a single request is queued (nobody to starve).
        if config.long_prefill_token_threshold and len(before.running) + len(before.waiting) > 1:
            _require(
                num_tokens <= config.long_prefill_token_threshold,
                f"{request_id!r}: {num_tokens} tokens over long_prefill_token_threshold",
            )
    for new in output.scheduled_new_reqs:
        _require(
            new.block_ids == kvc.blocks_of(after.kv, new.req_id),
            f"new {new.req_id!r}: block ids {new.block_ids} are not its table",
        )
    embeds = 0
    for request_id, positions in output.scheduled_encoder_inputs.items():
        request = after.requests[request_id]
        start = span[request_id][0]
        end = start + scheduled[request_id]
        for position in positions:
            item = request.mm_inputs[position]
            embeds += item.num_embeds
            _require(
                item.offset < end and item.end > start,
                f"{request_id!r} encodes input {position} outside its tokens [{start}, {end})",
            )
            _require(
                ec.is_cached(after.encoder, item.content_hash),
                f"{request_id!r} encodes input {position}, which is not cached",
            )
    _require(
        embeds <= config.encoder_compute_budget, f"{embeds} embeddings over the encoder budget"
    )
    for content_hash in output.free_encoder_hashes:
        _require(
            not ec.is_cached(after.encoder, content_hash),
            f"free notice for {content_hash!r}, which is still cached",
        )
    # vLLM's running loop ends early only when the token budget runs out (a request that
    # preempts itself lets the loop go on): with budget left, every request still running got
    # tokens, unless an encoder input it needs cannot run this step, or (async scheduling) its
    # step in flight already takes it to max_tokens or max_model_len.
    left = config.max_num_batched_tokens - output.total_num_scheduled_tokens
    if left > 0:
        for request_id in after.running:
            _require(
                request_id in scheduled
                or bool(after.requests[request_id].mm_inputs)
                or _in_flight_to_the_end(after, request_id),
                f"running {request_id!r} got no tokens while {left} budget tokens were left",
            )
    for request_id in output.preempted_req_ids:
        _require(
            not kvc.has_request(after.kv, request_id) or request_id in scheduled,
            f"preempted {request_id!r} still holds blocks",
        )
    if output.preempted_req_ids:
        _require(
            not output.scheduled_new_reqs
            and not any(c.resumed_from_preemption for c in output.scheduled_cached_reqs),
            "waiting requests admitted in a step that preempted",
        )
        _require(
            not any(isinstance(job, kj.LoadJob) for job in output.kv_jobs),
            "a KV load started in a step that preempted (only the waiting loop starts loads)",
        )
    for job in output.kv_jobs:
        if isinstance(job, kj.LoadJob):
            _require(
                job.req_id in after.kv_jobs.holding
                and after.kv_jobs.loading.get(job.req_id) == job.job_id,
                f"load {job.job_id} started for {job.req_id!r}, which is not holding for it",
            )
    for request_id in output.finished_req_ids:
        _require(
            request_id in after.requests or not kvc.has_request(after.kv, request_id),
            f"finished {request_id!r} still holds blocks",
        )
    _check_output_slots(before, after, output)


def _check_output_slots(
    before: SchedulerState, after: SchedulerState, output: SchedulerOutput
) -> None:
    """Each scheduled request runs on the slot it holds; a slot changes owner only through a
    reset: every request admitted this step (exactly those scheduled from token 0) starts on a
    slot that was free before the step and is zeroed first."""
    slots = after.state_slots
    if slots is None:
        _require(
            not output.state_slots and not output.reset_state_slots,
            f"state slots {dict(output.state_slots)} / resets {output.reset_state_slots} "
            "without config.num_state_slots",
        )
        return
    scheduled = output.num_scheduled_tokens
    _require(
        tuple(output.state_slots) == tuple(scheduled),
        f"state_slots names {tuple(output.state_slots)}, expected the scheduled requests "
        f"{tuple(scheduled)} in batch order",
    )
    for request_id, slot in output.state_slots.items():
        _require(
            ss.slot_of(slots, request_id) == slot,
            f"{request_id!r} scheduled on state slot {slot}, but holds "
            f"{ss.slot_of(slots, request_id)}",
        )
    admitted = [c.req_id for c in output.scheduled_cached_reqs if c.resumed_from_preemption]
    admitted += [n.req_id for n in output.scheduled_new_reqs]
    expected = tuple(sorted(output.state_slots[request_id] for request_id in admitted))
    _require(
        output.reset_state_slots == expected,
        f"reset_state_slots {output.reset_state_slots}, expected the slots {expected} of the "
        f"requests admitted this step {admitted}",
    )
    fresh = set(before.state_slots.free)
    for request_id in admitted:
        slot = output.state_slots[request_id]
        _require(
            slot in fresh,
            f"{request_id!r} admitted on state slot {slot}, which was not free before the step "
            f"(held by {[r for r, s in before.state_slots.owners.items() if s == slot]})",
        )
        # A zeroed state is right only for a request that computes from its first token.
        _require(
            after.requests[request_id].num_computed_tokens == 0,
            f"{request_id!r} admitted on a zeroed state slot with "
            f"{after.requests[request_id].num_computed_tokens} tokens already computed",
        )
    span = _positions(after, output)
    for request_id in scheduled:
        _require(
            span[request_id][0] > 0 or output.state_slots[request_id] in output.reset_state_slots,
            f"{request_id!r} starts from token 0 on state slot {output.state_slots[request_id]}, "
            "which is not reset",
        )
    for request_id in output.preempted_req_ids:
        _require(
            ss.slot_of(slots, request_id) is None,
            f"preempted {request_id!r} still holds state slot {ss.slot_of(slots, request_id)}",
        )


def _positions(after: SchedulerState, output: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """Each scheduled request's (first position this step computes, tokens it has counting the
    placeholders of its steps in flight before this one)."""
    positions = {}
    for data in (*output.scheduled_new_reqs, *output.scheduled_cached_reqs):
        request = after.requests[data.req_id]
        placeholders = 0
        if after.config.async_scheduling:
            earlier = after.in_flight.get(data.req_id, ())[:-1]
            placeholders = ahead(earlier)[1]
        positions[data.req_id] = (data.num_computed_tokens, request.num_tokens + placeholders)
    return positions


def _in_flight_to_the_end(after: SchedulerState, request_id: str) -> bool:
    """Async scheduling: the request's steps in flight compute all it has (a pooling request's
    last chunk) or reach max_tokens or max_model_len, so it has nothing to schedule until they
    are applied."""
    entries = after.in_flight.get(request_id)
    if not entries:
        return False
    request = after.requests[request_id]
    tokens, placeholders = ahead(entries)
    computed = request.num_computed_tokens + tokens
    if computed >= request.num_tokens + placeholders:
        return True
    if not placeholders:
        return False
    max_tokens = request.sampling_params.max_tokens
    return computed >= after.config.max_model_len - 1 or (
        max_tokens is not None
        and computed + 2 - placeholders >= request.num_prompt_tokens + max_tokens
    )
