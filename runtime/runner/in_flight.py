"""A step the runner has dispatched to the device and not yet read back.

JAX dispatch returns before the device has run the step, so `ModelRunner.dispatch` hands back
this record right after the call and `ModelRunner.collect` reads the sampled ids only when the
engine needs them (async scheduling plans and dispatches the next step in between, as vLLM's
async model runner does).

Until then each row that samples in the step holds a placeholder for its token at the end of
its token list: `placeholder(i)` = -1 - i, i its row among the step's sampled ids. The next
step's batch carries the placeholder, and the jitted step takes the token from this step's
sampled ids on the device (model_runner._step); `fill` writes the real ids over them once read.
What only counts tokens (min_tokens, a seeded row's output position) is right with a
placeholder; what reads their values (penalties, bad words) waits for the step
(`ModelRunner._needs_values`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.core.outputs import ModelRunnerOutput


def placeholder(row: int) -> int:
    return -1 - row


@dataclass
class StepInFlight:
    step: int
    order: tuple[str, ...]  # the step's requests in batch order
    # The rest is None for a step that ran nothing on the device (`output` is then set).
    sampling_req_ids: tuple[str, ...] = ()  # rows of the sampled ids
    out: object = None  # the sampler's device output
    sampling: list = field(default_factory=list)  # RequestRows in sampled-id order
    num_logprobs: int | None = None
    # Prompt logprobs dispatched with the step: request id -> (width, device arrays).
    prompt_logprobs: dict | None = None
    # (token list, index) of each placeholder, in sampled-id order.
    placeholders: list[tuple[list[int], int]] = field(default_factory=list)
    # Set once read back (or at once for a step with nothing to run).
    output: ModelRunnerOutput | None = None

    def fill(self, sampled: dict[str, int]) -> None:
        """Write the sampled ids over the placeholders (a row dropped or replaced since keeps
        an unused list: harmless)."""
        for (tokens, index), rid in zip(self.placeholders, self.sampling_req_ids, strict=True):
            tokens[index] = sampled[rid]
        self.placeholders = []
