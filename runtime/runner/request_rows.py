"""The runner's mirror of live requests, kept in step with the scheduler, and undone on failure.

`apply` changes the mirror by one `SchedulerOutput` and returns an undo log; `undo` puts the
mirror back as it was. The runner undoes a step that failed before the device ran it, so that the
engine, which then keeps the scheduler state of before that step, can schedule again from it: the
mirror must then match that state (a block table extended twice would point at wrong blocks).
"""

from __future__ import annotations

from runtime.core.outputs import SchedulerOutput
from runtime.runner.inputs import RequestRow

# Undo entries: (request id, the row it had or None, or for a changed row the values it had).
_REMOVED, _ADDED, _CHANGED = 0, 1, 2


def apply(
    rows: dict[str, RequestRow], scheduler_output: SchedulerOutput
) -> tuple[list[str], list[tuple]]:
    """Apply `so` to `rows`; returns the scheduled ids in batch order, and the undo log."""
    log: list[tuple] = []
    for rid in scheduler_output.finished_req_ids:
        row = rows.pop(rid, None)
        if row is not None:
            log.append((_REMOVED, rid, row))
    order = []
    for cached in scheduler_output.scheduled_cached_reqs:
        row = rows[cached.req_id]
        log.append(
            (
                _CHANGED,
                row,
                row.block_ids,
                len(row.block_ids),
                row.token_ids,
                row.num_computed_tokens,
            )
        )
        if cached.resumed_from_preemption:
            row.block_ids = list(cached.new_block_ids)
            if cached.all_token_ids is not None:
                row.token_ids = list(cached.all_token_ids)
        else:
            row.block_ids.extend(cached.new_block_ids)
        row.num_computed_tokens = cached.num_computed_tokens
        order.append(cached.req_id)
    for new_request in scheduler_output.scheduled_new_reqs:
        log.append((_ADDED, new_request.req_id, rows.get(new_request.req_id)))
        rows[new_request.req_id] = RequestRow(
            new_request.req_id,
            list(new_request.prompt_token_ids),
            list(new_request.block_ids),
            prompt_len=len(new_request.prompt_token_ids),
            sampling_params=new_request.sampling_params,
            num_computed_tokens=new_request.num_computed_tokens,
            eos_token_ids=new_request.eos_token_ids,
            mm_inputs=new_request.mm_inputs,
        )
        order.append(new_request.req_id)
    return order, log


def undo(rows: dict[str, RequestRow], log: list[tuple]) -> None:
    """Put `rows` back as they were before the `apply` that returned `log`."""
    for entry in reversed(log):
        kind = entry[0]
        if kind == _CHANGED:
            _, row, block_ids, num_blocks, token_ids, num_computed = entry
            del block_ids[num_blocks:]  # extended in place, or replaced (then untouched)
            row.block_ids, row.token_ids, row.num_computed_tokens = (
                block_ids,
                token_ids,
                num_computed,
            )
        elif kind == _ADDED:
            _, rid, previous = entry
            if previous is None:
                del rows[rid]
            else:
                rows[rid] = previous
        else:
            _, rid, row = entry
            rows[rid] = row
