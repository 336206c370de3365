"""What changed between two scheduler states, as plain data (for notebooks and test failures)."""

from runtime.core.kv import block_pool as bp
from runtime.core.scheduling.scheduler_state import SchedulerState

__all__ = ["state_diff"]

_REQUEST_FIELDS = ("status", "num_computed_tokens", "num_output_tokens", "num_preemptions")


def state_diff(before: SchedulerState, after: SchedulerState) -> dict:
    """A dict of what differs: queues, per-request progress, KV blocks, state slots (request id ->
    (old slot, new slot)) and encoder entries.

    Unchanged parts are left out. Requests compare by identity first, so the cost is that of the
    requests that changed plus one pass over the ids."""
    diff: dict = {}
    for name in ("step", "waiting", "running", "finished_since_last", "awaiting_update"):
        old, new = getattr(before, name), getattr(after, name)
        if old != new:
            diff[name] = (old, new)
    requests = {}
    for request_id in sorted(set(before.requests) | set(after.requests)):
        old, new = before.requests.get(request_id), after.requests.get(request_id)
        if old is new:
            continue
        if old is None or new is None:
            requests[request_id] = "added" if old is None else "removed"
            continue
        changes = {
            field: (_field(old, field), _field(new, field))
            for field in _REQUEST_FIELDS
            if _field(old, field) != _field(new, field)
        }
        if changes:
            requests[request_id] = changes
    if requests:
        diff["requests"] = requests
    tables = {}
    for request_id in sorted(set(before.kv.tables) | set(after.kv.tables)):
        old, new = before.kv.tables.get(request_id), after.kv.tables.get(request_id)
        if old != new:
            tables[request_id] = (old, new)
    if tables:
        diff["block_tables"] = tables
    if before.state_slots is not after.state_slots:
        old = dict(before.state_slots.owners) if before.state_slots is not None else {}
        new = dict(after.state_slots.owners) if after.state_slots is not None else {}
        slots = {
            request_id: (old.get(request_id), new.get(request_id))
            for request_id in sorted(set(old) | set(new))
            if old.get(request_id) != new.get(request_id)
        }
        if slots:
            diff["state_slots"] = slots
    counts = {
        "free_blocks": (before.kv.pool.num_free, after.kv.pool.num_free),
        "cached_blocks": (
            bp.num_cached_blocks(before.kv.pool),
            bp.num_cached_blocks(after.kv.pool),
        ),
        "encoder_entries": (sorted(before.encoder.entries), sorted(after.encoder.entries)),
        "encoder_free_embeds": (before.encoder.num_free, after.encoder.num_free),
    }
    diff.update({name: pair for name, pair in counts.items() if pair[0] != pair[1]})
    return diff


def _field(request, name: str):
    value = getattr(request, name)
    return value.name if hasattr(value, "name") else value
