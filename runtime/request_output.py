"""What the engine reports for a finished request, in vLLM's shapes (`vlax.outputs` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the top-k plus the sampled token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    # "stop", "length", "abort" or "error" (vLLM's FinishReason values); None while unfinished.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With finish_reason "error": what went wrong serving this sample (the others went on).
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
