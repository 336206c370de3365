"""After the core, for a pooling engine: each finished pooling request's PoolingRequestOutput.

The engine's OutputProcessor for generation has the same members (the engine calls one or the
other); a pooling request is one core request, reported once, in the step the core finished it
with its pooled output, or when it is aborted or fails (then with no output).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runtime.core import scheduler as sched
from runtime.core.outputs import EngineCoreOutput
from runtime.core.request import FinishReason
from runtime.core.scheduling.scheduler_state import SchedulerState
from runtime.input_processor import ProcessedRequest
from runtime.pooling_outputs import PoolingOutput, PoolingRequestOutput


class PoolingOutputProcessor:
    def __init__(self) -> None:
        self.requests: dict[str, ProcessedRequest] = {}
        # Pooling generates nothing; the engine's progress bar reads this.
        self.num_generated_tokens = 0
        self.num_pooled_tokens = 0

    def add(self, processed: ProcessedRequest) -> None:
        self.requests[processed.request_id] = processed

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def samples_of(self, request_ids: Iterable[str]) -> list[str]:
        """The core request ids of these requests (one each; the id is the same)."""
        return [rid for rid in request_ids if rid in self.requests]

    def process(
        self,
        scheduled: SchedulerState,
        updated: SchedulerState,
        outputs: Sequence[EngineCoreOutput],
    ) -> tuple[SchedulerState, list[PoolingRequestOutput]]:
        finished = []
        for out in outputs:
            if out.pooling_output is None:
                continue
            processed = self.requests.pop(out.req_id)
            self.num_pooled_tokens += len(processed.prompt_token_ids)
            finished.append(
                PoolingRequestOutput(
                    request_id=out.req_id,
                    outputs=PoolingOutput(out.pooling_output),
                    prompt_token_ids=list(processed.prompt_token_ids),
                    prompt=processed.prompt,
                    finish_reason=out.finish_reason.value,
                )
            )
        return updated, finished

    def finish(
        self,
        state: SchedulerState,
        sample_ids: Sequence[str],
        reason: FinishReason,
        error: str | None = None,
    ) -> tuple[SchedulerState, list[PoolingRequestOutput]]:
        """End unfinished requests from outside (abort; a step that failed on them)."""
        in_core, finished = [], []
        for rid in dict.fromkeys(sample_ids):
            processed = self.requests.pop(rid)
            if sched.has_request(state, rid):
                in_core.append(rid)
            finished.append(
                PoolingRequestOutput(
                    request_id=rid,
                    outputs=None,
                    prompt_token_ids=list(processed.prompt_token_ids),
                    prompt=processed.prompt,
                    finish_reason=reason.value,
                    error=error,
                )
            )
        if in_core:
            state = sched.finish_requests(state, in_core, reason)
        return state, finished
