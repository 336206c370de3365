"""What the soak checks after a run: one final output per request, tokens equal to a fault-free
run, nothing left held, and the process's resident memory."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from benchmarks.soak_workload import SoakRequest
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj
from runtime.core.request import FinishReason
from runtime.core.scheduling.scheduler_invariants import check_state


@dataclass
class Final:
    reason: FinishReason | None
    token_ids: list[int]


@dataclass
class Outputs:
    """The final outputs of one run, by workload index."""

    finals: dict[int, list[Final]] = field(default_factory=dict)
    stray: int = 0  # a final output for an id no live request holds

    def add(self, index: int | None, output) -> None:
        """Record `output`, a finished request's RequestOutput, for workload request `index`."""
        if index is None:
            self.stray += 1
            return
        (completion,) = output.outputs
        reason = FinishReason(completion.finish_reason) if completion.finish_reason else None
        self.finals.setdefault(index, []).append(Final(reason, list(completion.token_ids)))


def check_outputs(
    workload: list[SoakRequest],
    outputs: Outputs,
    reference: dict[int, list[int]],
    max_model_len: int,
) -> dict:
    lost = duplicated = bad_reason = mismatched = checked = 0
    examples = []
    reasons: Counter = Counter()
    for req in workload:
        finals = outputs.finals.get(req.index, [])
        if not finals:
            lost += 1
            continue
        if len(finals) > 1:
            duplicated += 1
        final = finals[0]
        reasons[final.reason.name.lower() if final.reason else "none"] += 1
        if not _reason_fits(req, final, max_model_len):
            bad_reason += 1
            examples.append(f"{req.request_id} (#{req.index}): {final.reason} {final.token_ids}")
        if final.reason is FinishReason.ABORT or not req.checked:
            continue
        checked += 1
        if final.token_ids != reference[req.index]:
            mismatched += 1
            examples.append(
                f"{req.request_id} (#{req.index}) tokens {final.token_ids} != reference "
                f"{reference[req.index]}"
            )
    return {
        "outputs_lost": lost,
        "outputs_duplicated": duplicated,
        "outputs_stray": outputs.stray,
        "bad_finish_reasons": bad_reason,
        "finish_reasons": dict(reasons),
        "checked_requests": checked,
        "mismatched_tokens": mismatched,
        "examples": examples[:5],
    }


def _reason_fits(req: SoakRequest, final: Final, max_model_len: int) -> bool:
    n, limit = len(final.token_ids), req.params.max_tokens
    if final.reason is FinishReason.ABORT:
        return n <= limit
    if final.reason is FinishReason.LENGTH:
        return n == limit or len(req.prompt_token_ids) + n == max_model_len
    if final.reason is FinishReason.STOP:
        params = req.params
        stoppable = not params.ignore_eos or params.stop or params.stop_token_ids
        # A stop string may end a request inside its first token (the string is cut off).
        return 0 <= n <= limit and bool(stoppable)
    return False


def check_nothing_held(engine) -> dict:
    """After the engine went idle: every block free, no pin, job, queued request or runner row."""
    state = engine.state
    problems = []
    try:
        check_state(state)
    except AssertionError as err:
        problems.append(f"scheduler invariant: {err}")
    jobs = state.kv_jobs
    usable = engine.runner.num_kv_blocks - 1
    pins = kj.pins(jobs) if jobs is not None else Counter()
    in_flight = len(jobs.in_flight) if jobs is not None else 0
    worker = engine.offloader.num_in_flight if engine.offloader is not None else 0
    loading = len(jobs.loading) + len(jobs.store_cursor) if jobs is not None else 0
    # The runner drops a request's row when the next step's output names it finished: rows may
    # wait for exactly the ids the scheduler has yet to report, nothing else.
    rows = set(engine.runner.rows) - set(state.finished_since_last)
    tracked = engine.output_processor
    slots = len(rows) + len(state.requests) + len(tracked.requests) + len(tracked.samples)
    return {
        "leaked_blocks": usable - kvc.num_free_blocks(state.kv),
        "leaked_pins": sum(pins.values()),
        "leaked_jobs": in_flight + worker + loading,
        "leaked_slots": slots + engine.num_awaiting_lookup,
        "invariant_errors": problems,
    }


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def shm_segments(directory: str = "/dev/shm") -> set[str]:
    from runtime.offload.shm_segments import SEGMENT_PREFIX

    return {name for name in os.listdir(directory) if name.startswith(SEGMENT_PREFIX)}
