"""Record a scheduler run as its inputs, and replay it to the identical sequence of outputs.

A run's inputs are, per step: the requests that arrive, the requests aborted, and the runner
output fed to `update`. The scheduler is a pure function of them, so `replay(trace)` gives the
same `SchedulerOutput`s and engine outputs, and every state of a run can be kept and revisited
(states are values: later steps never change them).

Step k: arrivals are added, aborts applied, then schedule, then update with the runner output.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from runtime.core import scheduler as sch
from runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from runtime.core.request import Request
from runtime.core.scheduling.scheduler_config import SchedulerConfig

__all__ = ["Run", "StepInputs", "Trace", "record", "replay"]

Runner = Callable[[sch.SchedulerState, SchedulerOutput], ModelRunnerOutput]


@dataclass(frozen=True, slots=True)
class StepInputs:
    arrivals: tuple[Request, ...]
    aborts: tuple[str, ...]
    runner_output: ModelRunnerOutput


@dataclass(frozen=True, slots=True)
class Trace:
    config: SchedulerConfig
    steps: tuple[StepInputs, ...]


@dataclass(frozen=True, slots=True)
class Run:
    trace: Trace
    # Per step: the state schedule() started from (arrivals and aborts applied), the state it
    # returned, its output, and what update() returned.
    before: tuple[sch.SchedulerState, ...]
    scheduled: tuple[sch.SchedulerState, ...]
    outputs: tuple[SchedulerOutput, ...]
    engine_outputs: tuple[tuple[EngineCoreOutput, ...], ...]
    final: sch.SchedulerState


def record(
    config: SchedulerConfig,
    arrivals: Mapping[int, Sequence[Request]],
    runner: Runner,
    *,
    aborts: Mapping[int, Sequence[str]] | None = None,
    max_steps: int = 10_000,
) -> Run:
    """Run until every request finished and none is still to arrive; record the inputs.

    `runner(state, output)` plays the model: it gets the state schedule() returned and its
    output, and returns what the runner computed."""
    aborts = aborts or {}
    for name, events in (("arrivals", arrivals), ("aborts", aborts)):
        bad = [k for k in events if not isinstance(k, int) or k < 0]
        if bad:
            raise ValueError(f"record: {name} keyed by step {bad[0]!r}; expected ints >= 0")
    last_event = max((*arrivals, *aborts), default=-1)
    state = sch.make_scheduler(config)
    steps = []
    for step in range(max_steps):
        if step > last_event and not sch.has_unfinished_requests(state):
            return _run(config, steps, state)
        state = _inputs(state, tuple(arrivals.get(step, ())), tuple(aborts.get(step, ())))
        scheduled, out = sch.schedule(state)
        runner_output = runner(scheduled, out)
        steps.append(
            (
                StepInputs(
                    tuple(arrivals.get(step, ())), tuple(aborts.get(step, ())), runner_output
                ),
                state,
                scheduled,
                out,
            )
        )
        state, engine_outputs = sch.update(scheduled, out, runner_output)
        steps[-1] += (engine_outputs,)
    raise RuntimeError(f"record: requests still unfinished after max_steps={max_steps}")


def replay(trace: Trace) -> Run:
    """Re-run a trace from its inputs alone."""
    state = sch.make_scheduler(trace.config)
    steps = []
    for inputs in trace.steps:
        state = _inputs(state, inputs.arrivals, inputs.aborts)
        scheduled, out = sch.schedule(state)
        after, engine_outputs = sch.update(scheduled, out, inputs.runner_output)
        steps.append((inputs, state, scheduled, out, engine_outputs))
        state = after
    return _run(trace.config, steps, state)


def _inputs(state: sch.SchedulerState, arrivals, aborts) -> sch.SchedulerState:
    for request in arrivals:
        state = sch.add_request(state, request)
    return sch.abort_requests(state, aborts) if aborts else state


def _run(config: SchedulerConfig, steps: list, final: sch.SchedulerState) -> Run:
    return Run(
        trace=Trace(config, tuple(s[0] for s in steps)),
        before=tuple(s[1] for s in steps),
        scheduled=tuple(s[2] for s in steps),
        outputs=tuple(s[3] for s in steps),
        engine_outputs=tuple(s[4] for s in steps),
        final=final,
    )
