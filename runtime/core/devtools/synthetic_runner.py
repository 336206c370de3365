"""Model-runner outputs made from a schedule alone, to drive the scheduler without a model.

Used by tests, notebooks and benchmarks. The tokens come from a caller-given function of the
request, so runs are reproducible and a test can steer stop conditions.

`recurrent_runner_output` plays a hybrid model instead: each request's tokens go through the
recurrent state in its slot, and the sampled token depends on that state alone, so a request
that starts from a state it did not build (not reset, inherited from a previous owner, or missing
the tokens of a skipped chunk) samples other tokens than when it runs alone.
"""

from collections.abc import Callable, Sequence

from runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from runtime.core.request import Request
from runtime.core.scheduling.scheduler_state import SchedulerState

__all__ = [
    "ZERO_STATE",
    "absorb",
    "counting_token",
    "make_slot_states",
    "recurrent_runner_output",
    "runner_output",
    "state_token",
]

# A synthetic recurrent state: (tokens absorbed, a running hash of them). Fixed-size, as a real
# one is: nothing in it tells a runner whether it belongs to the request reading it.
RecurrentState = tuple[int, int]
ZERO_STATE: RecurrentState = (0, 0)
_MODULUS = (1 << 61) - 1


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


def absorb(state: RecurrentState, tokens: Sequence[int]) -> RecurrentState:
    """The state after reading `tokens` in order."""
    count, digest = state
    for token in tokens:
        count += 1
        digest = (digest * 1_000_003 + token + 1) % _MODULUS
    return count, digest


def state_token(state: RecurrentState) -> int:
    """The synthetic hybrid model's next token: a function of the recurrent state alone."""
    return (state[1] + 7 * state[0]) % 30000 + 3


def make_slot_states(num_slots: int) -> tuple[RecurrentState, ...]:
    """The device pool before any reset: not zero, so a first owner that is not reset shows."""
    return tuple((-1, slot) for slot in range(num_slots))


def recurrent_runner_output(
    slot_states: tuple[RecurrentState, ...],
    state: SchedulerState,
    output: SchedulerOutput,
    token_of: Callable[[RecurrentState], int] = state_token,
) -> tuple[tuple[RecurrentState, ...], ModelRunnerOutput]:
    """What a hybrid model's runner computes for `output` (scheduled from the state before
    `state`): zero the reset slots, then feed each request's scheduled tokens through the state
    in its slot; one token, `token_of` that state, for each request that reaches its last token.
    Returns the slots' new states and the runner output."""
    states = list(slot_states)
    for slot in output.reset_state_slots:
        states[slot] = ZERO_STATE
    req_ids, rows = [], []
    ended = frozenset(state.finished_since_last)
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        request = state.requests.get(request_id)
        if request is None or request_id in ended:  # finished since; the runner drops it
            continue
        slot = output.state_slots[request_id]
        start = request.num_computed_tokens
        states[slot] = absorb(states[slot], request.all_token_ids[start : start + num_tokens])
        req_ids.append(request_id)
        done = start + num_tokens >= request.num_tokens
        rows.append((token_of(states[slot]),) if done else ())
    runner = ModelRunnerOutput(req_ids=tuple(req_ids), sampled_token_ids=tuple(rows))
    return tuple(states), runner
