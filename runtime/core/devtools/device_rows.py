"""A synthetic runner that keeps its own copy of each request's tokens, as a device does.

It executes a SchedulerOutput from the output alone, as vLLM's model runner does under async
scheduling: the tokens it samples stay in its own rows and feed the request's next step, whether
or not the core has applied them yet (the core plans that step with a placeholder). Its rows
follow the output's messages: new requests bring their prompt, resumed ones all their tokens,
finished and preempted ones are dropped. A step whose positions or tokens do not line up with
what the rows hold (a placeholder counted twice or never, a resumed request missing a token)
raises, and wrong positions change the tokens, so the scheduler's async bookkeeping is checked
against what a device would compute.

`token_of(prompt, tokens)` gives the next token from the request's tokens so far; with
`num_state_slots`, the tokens also pass through a recurrent state in the request's slot, and
`token_of` gets (prompt, that state) instead.
"""

from collections.abc import Callable

from runtime.core.devtools.synthetic_runner import ZERO_STATE, absorb, make_slot_states
from runtime.core.outputs import ModelRunnerOutput, SchedulerOutput

__all__ = ["DeviceRows"]


class DeviceRows:
    def __init__(self, token_of: Callable, num_state_slots: int = 0) -> None:
        self.token_of = token_of
        self.prompts: dict[str, tuple[int, ...]] = {}  # unfinished requests seen as new
        self.rows: dict[str, list[int]] = {}  # scheduled requests' tokens (not preempted ones)
        self.slot_states = list(make_slot_states(num_state_slots))
        self.hybrid = num_state_slots > 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_req_ids:
            self.prompts.pop(request_id, None)
            self.rows.pop(request_id, None)
        for request_id in output.preempted_req_ids:
            del self.rows[request_id]
        for new in output.scheduled_new_reqs:
            self.prompts[new.req_id] = new.prompt_token_ids
            self.rows[new.req_id] = list(new.prompt_token_ids)
        for cached in output.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                if cached.req_id not in self.prompts:
                    raise AssertionError(f"resumed {cached.req_id!r} was never seen as new")
                self.rows[cached.req_id] = list(cached.all_token_ids)
        for slot in output.reset_state_slots:
            self.slot_states[slot] = ZERO_STATE
        starts = {
            data.req_id: data.num_computed_tokens
            for data in (*output.scheduled_new_reqs, *output.scheduled_cached_reqs)
        }
        req_ids, sampled = [], []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            prompt, tokens = self.prompts[request_id], self.rows[request_id]
            start = starts[request_id]
            end = start + num_tokens
            if end > len(tokens):
                raise AssertionError(
                    f"step {output.step}: {request_id!r} computes positions {start}..{end - 1} "
                    f"but the device holds {len(tokens)} tokens"
                )
            done = end == len(tokens)
            if self.hybrid:
                slot = output.state_slots[request_id]
                self.slot_states[slot] = absorb(self.slot_states[slot], tokens[start:end])
                token = self.token_of(prompt, self.slot_states[slot]) if done else None
            else:
                token = self.token_of(prompt, tokens[:end]) if done else None
            if token is not None:
                tokens.append(token)
            req_ids.append(request_id)
            sampled.append(() if token is None else (token,))
        return ModelRunnerOutput(req_ids=tuple(req_ids), sampled_token_ids=tuple(sampled))
