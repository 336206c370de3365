"""Model-runner outputs made from a schedule alone, to drive the scheduler without a model.

Used by tests, notebooks and benchmarks. The tokens come from a caller-given function of the
request, so runs are reproducible and a test can steer stop conditions.
"""

from collections.abc import Callable

from runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from runtime.core.request import Request
from runtime.core.scheduling.scheduler_state import SchedulerState

__all__ = ["counting_token", "runner_output"]


def counting_token(request: Request) -> int:
    """A token that depends only on the request's position (stable across runs and processes)."""
    return (request.num_tokens * 7919 + len(request.prompt_token_ids)) % 30000 + 3


def runner_output(
    state: SchedulerState,
    output: SchedulerOutput,
    token_for: Callable[[Request], int] = counting_token,
) -> ModelRunnerOutput:
    """What a runner would return for `output` (scheduled from the state before `state`): one
    token for each request that reaches its last token this step, none for partial prefills."""
    req_ids, rows = [], []
    ended = frozenset(state.finished_since_last)
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        request = state.requests.get(request_id)
        if request is None or request_id in ended:  # finished since; the runner drops it
            continue
        req_ids.append(request_id)
        done = request.num_computed_tokens + num_tokens >= request.num_tokens
        rows.append((token_for(request),) if done else ())
    return ModelRunnerOutput(req_ids=tuple(req_ids), sampled_token_ids=tuple(rows))
