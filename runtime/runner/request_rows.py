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


def apply(rows: dict[str, RequestRow], so: SchedulerOutput) -> tuple[list[str], list[tuple]]:
    """Apply `so` to `rows`; returns the scheduled ids in batch order, and the undo log."""
    log: list[tuple] = []
    for rid in so.finished_req_ids:
        row = rows.pop(rid, None)
        if row is not None:
            log.append((_REMOVED, rid, row))
    order = []
    for cd in so.scheduled_cached_reqs:
        row = rows[cd.req_id]
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
        if cd.resumed_from_preemption:
            row.block_ids = list(cd.new_block_ids)
            if cd.all_token_ids is not None:
                row.token_ids = list(cd.all_token_ids)
        else:
            row.block_ids.extend(cd.new_block_ids)
        row.num_computed_tokens = cd.num_computed_tokens
        order.append(cd.req_id)
    for nd in so.scheduled_new_reqs:
        log.append((_ADDED, nd.req_id, rows.get(nd.req_id)))
        rows[nd.req_id] = RequestRow(
            nd.req_id,
            list(nd.prompt_token_ids),
            list(nd.block_ids),
            prompt_len=len(nd.prompt_token_ids),
            sampling_params=nd.sampling_params,
            num_computed_tokens=nd.num_computed_tokens,
            eos_token_ids=nd.eos_token_ids,
        )
        order.append(nd.req_id)
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
