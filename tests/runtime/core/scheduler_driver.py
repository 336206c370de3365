"""Helpers that drive the scheduler with synthetic runner outputs and check every step."""

from runtime.core import scheduler as sch
from runtime.core.devtools.synthetic_runner import counting_token, runner_output
from runtime.core.request import MultiModalInput, Request, SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_output, check_state

DEFAULTS = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "block_size": 4,
    "num_blocks": 33,
}


def make(**overrides) -> sch.SchedulerState:
    return sch.make_scheduler(sch.SchedulerConfig(**{**DEFAULTS, **overrides}))


def request(
    request_id: str,
    prompt: int | tuple[int, ...],
    max_tokens: int | None = 4,
    *,
    mm: tuple[MultiModalInput, ...] = (),
    arrival: float = 0.0,
    priority: int = 0,
    eos: int | None = None,
    **params,
) -> Request:
    """A request whose prompt is `prompt` token ids, or that many ids derived from its id."""
    if isinstance(prompt, int):
        base = sum(map(ord, request_id)) * 101
        prompt = tuple((base + i) % 997 + 3 for i in range(prompt))
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=() if eos is None else (eos,),
        arrival_time=arrival,
        priority=priority,
        mm_inputs=mm,
    )


def add(state, *requests):
    for r in requests:
        state = sch.add_request(state, r)
        check_state(state)
    return state


def schedule(state):
    """schedule() with the state and output invariants checked."""
    after, out = sch.schedule(state)
    check_state(after)
    check_output(state, after, out)
    return after, out


def step(state, token_for=counting_token):
    """schedule + synthetic runner + update; returns (state, output, engine outputs)."""
    scheduled, out = schedule(state)
    state, outputs = sch.update(scheduled, out, runner_output(scheduled, out, token_for))
    check_state(state)
    return state, out, outputs


def run(state, max_steps=200, token_for=counting_token):
    """Step until nothing is unfinished; returns (state, [outputs], {req: (tokens, reason)})."""
    outs, results = [], {}
    for _ in range(max_steps):
        if not sch.has_unfinished_requests(state):
            return state, outs, results
        state, out, engine_outputs = step(state, token_for)
        outs.append(out)
        for o in engine_outputs:
            tokens, _ = results.get(o.req_id, ((), None))
            results[o.req_id] = (tokens + o.new_token_ids, o.finish_reason)
    raise AssertionError(f"not finished after {max_steps} steps: {state}")


def tokens_per_step(outs):
    return [dict(o.num_scheduled_tokens) for o in outs]
