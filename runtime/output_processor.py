"""After the core: detokenize, find stop strings, and assemble each finished request's RequestOutput.

One owner per fact:
- tokens: the core's `Request.output_token_ids`; this module keeps none of its own, and reads a
  request's tokens from the core state when it finishes;
- how a request ended: here. The core ends requests on EOS, stop ids and length and says so in
  its outputs; a stop string found here ends the request through one core transition
  (`finish_requests`) in the same step; aborts and errors the engine meets come through `finish`.
  Every final reason and stop_reason is decided in `_finish_sample`.

A sample whose output processing raises (its detokenizer, say) finishes with finish_reason
"error" and the message in `CompletionOutput.error`; the others go on. With n > 1 a request has
one core request per sample, and its RequestOutput is reported when the last of them finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from runtime.core import scheduler as sched
from runtime.core.outputs import EngineCoreOutput, LogprobsEntry
from runtime.core.request import FinishReason
from runtime.core.scheduling.scheduler_state import SchedulerState
from runtime.detokenizer import IncrementalDetokenizer
from runtime.input_processor import ProcessedRequest
from runtime.request_output import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    """One request as the caller sees it, until its last sample finishes."""

    processed: ProcessedRequest
    completions: list[CompletionOutput | None]
    unfinished: int
    prompt_logprobs: list[LogprobsEntry] = field(default_factory=list)


@dataclass(slots=True)
class _Sample:
    """One core request (a sample of `parent`) while it runs: text so far and logprobs."""

    parent: _Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[LogprobsEntry] | None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        # Live samples by core request id, live requests by request id.
        self.samples: dict[str, _Sample] = {}
        self.requests: dict[str, _Request] = {}
        self.num_generated_tokens = 0

    def add(self, processed: ProcessedRequest) -> None:
        """Track a request the engine just admitted."""
        n = len(processed.children)
        parent = _Request(processed, [None] * n, n)
        self.requests[processed.request_id] = parent
        for index, child in enumerate(processed.children):
            params = child.sampling_params
            detokenizer = (
                None
                if self.tokenizer is None or not params.detokenize
                else IncrementalDetokenizer(self.tokenizer, params, processed.prompt_token_ids)
            )
            self.samples[child.request_id] = _Sample(
                parent, index, detokenizer, None if params.num_logprobs is None else []
            )

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def samples_of(self, request_ids: Iterable[str]) -> list[str]:
        """The core request ids of the unfinished samples of these requests."""
        out = []
        for rid in request_ids:
            parent = self.requests.get(rid)
            if parent is None:
                continue
            out.extend(
                child.request_id
                for child, done in zip(parent.processed.children, parent.completions, strict=True)
                if done is None
            )
        return out

    def process(
        self,
        scheduled: SchedulerState,
        updated: SchedulerState,
        outputs: Sequence[EngineCoreOutput],
    ) -> tuple[SchedulerState, list[RequestOutput]]:
        """Apply one step's core outputs. `scheduled` is the state `update` was given (it still
        holds the requests that finished in it), `updated` the state it returned. Returns the state
        after the stop-string and error finishes this step found, and the finished requests."""
        stops, errors, finished = [], [], []
        for out in outputs:
            sample = self.samples[out.req_id]
            self.num_generated_tokens += len(out.new_token_ids)
            try:
                stop = self._take(sample, out)
            except Exception as err:  # one request's failure must not stop the others
                log.exception("request %r: output processing failed", out.req_id)
                error = f"output processing failed: {err!r}"
                if not out.finished:
                    errors.append(out.req_id)
                tokens = _tokens(scheduled, updated, out)
                finished += self._finish_sample(out.req_id, tokens, FinishReason.ERROR, None, error)
                continue
            if stop is not None:
                # A stop string ends the request whatever the core decided for this token.
                if not out.finished:
                    stops.append(out.req_id)
                tokens = _tokens(scheduled, updated, out)
                finished += self._finish_sample(out.req_id, tokens, FinishReason.STOP, stop)
            elif out.finished:
                tokens = _tokens(scheduled, updated, out)
                finished += self._finish_sample(
                    out.req_id, tokens, out.finish_reason, out.stop_reason
                )
        state = updated
        if stops:
            state = sched.finish_requests(state, stops, FinishReason.STOP)
        if errors:
            state = sched.finish_requests(state, errors, FinishReason.ERROR)
        return state, finished

    def finish(
        self,
        state: SchedulerState,
        sample_ids: Sequence[str],
        reason: FinishReason,
        error: str | None = None,
    ) -> tuple[SchedulerState, list[RequestOutput]]:
        """End unfinished samples from outside (abort; a step that failed on them): one core
        transition, and the requests this completes."""
        in_core, finished = [], []
        for rid in dict.fromkeys(sample_ids):
            request = state.requests.get(rid)
            if request is not None:
                in_core.append(rid)
            # A sample the core does not hold (held back for a KV-store lookup) has no tokens.
            tokens = () if request is None else request.output_token_ids
            finished += self._finish_sample(rid, tokens, reason, None, error)
        if in_core:
            state = sched.finish_requests(state, in_core, reason)
        return state, finished

    def _take(self, sample: _Sample, out: EngineCoreOutput) -> str | None:
        """Record one step of a sample; returns the stop string its new text completed."""
        if out.new_logprobs is not None and sample.logprobs is not None:
            sample.logprobs.append(out.new_logprobs)
        if out.new_prompt_logprobs is not None and sample.index == 0:
            sample.parent.prompt_logprobs.append(out.new_prompt_logprobs)
        if sample.detokenizer is None:
            return None
        # The core stops on tokens only (EOS or a stop id): that token's text is left out.
        return sample.detokenizer.update(
            out.new_token_ids,
            stop_terminated=out.finish_reason is FinishReason.STOP,
            finished=out.finished,
        )

    def _finish_sample(
        self,
        sample_id: str,
        token_ids: Sequence[int],
        reason: FinishReason,
        stop_reason: int | str | None,
        error: str | None = None,
    ) -> list[RequestOutput]:
        """The one place a sample's final reason is written; returns its request's output once
        every sample of it has finished."""
        sample = self.samples.pop(sample_id)
        parent = sample.parent
        text = "" if sample.detokenizer is None else sample.detokenizer.output_text
        parent.completions[sample.index] = self._completion(
            sample, text, token_ids, reason, stop_reason, error
        )
        parent.unfinished -= 1
        if parent.unfinished:
            return []
        processed = parent.processed
        del self.requests[processed.request_id]
        prompt_logprobs = None
        if processed.params.prompt_logprobs is not None:
            decode = processed.params.detokenize
            prompt_logprobs = [None] + [
                p for e in parent.prompt_logprobs for p in self._positions(e, decode)
            ]
        return [
            RequestOutput(
                request_id=processed.request_id,
                prompt=processed.prompt,
                prompt_token_ids=list(processed.prompt_token_ids),
                prompt_logprobs=prompt_logprobs,
                outputs=list(parent.completions),
                finished=True,
            )
        ]

    def _completion(
        self,
        sample: _Sample,
        text: str,
        token_ids: Sequence[int],
        reason: FinishReason,
        stop_reason: int | str | None,
        error: str | None,
    ) -> CompletionOutput:
        logprobs = cumulative = None
        if sample.logprobs is not None:
            decode = sample.parent.processed.params.detokenize
            positions = [p for e in sample.logprobs for p in self._positions(e, decode)]
            logprobs = positions[: len(token_ids)]
            cumulative = sum(p[t].logprob for p, t in zip(logprobs, token_ids, strict=False))
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=reason.value,
            stop_reason=stop_reason,
            error=error,
        )

    def _positions(self, entry: LogprobsEntry, decode: bool) -> list[PositionLogprobs]:
        """Each position's logprobs, their tokens decoded unless the request asked for no
        detokenization (vLLM's detokenize=False: decoded_token None)."""
        out = []
        for ids, lps, rank in zip(
            entry.token_ids, entry.logprobs, entry.sampled_token_ranks, strict=True
        ):
            pos: PositionLogprobs = {}
            # Column 0 is the sampled (or actual next) token, then the top-k in rank order (or
            # the request's logprob_token_ids, ranked 1..n by their place). A token in both keeps
            # its later column's rank, as vLLM's dict of the columns does.
            for col, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
                seen = pos.get(tid)
                if seen is not None:
                    decoded = seen.decoded_token  # the sampled token again, in the top-k
                elif self.tokenizer is None or not decode:
                    decoded = None
                else:
                    decoded = self.tokenizer.decode([tid], skip_special_tokens=False)
                pos[tid] = Logprob(lp, rank if col == 0 else col, decoded)
            out.append(pos)
        return out


def _tokens(
    scheduled: SchedulerState, updated: SchedulerState, out: EngineCoreOutput
) -> tuple[int, ...]:
    """A sample's output tokens after this step, read from the core: from the updated state while
    it is still there, else (it finished in `update`) from before the update plus this step's."""
    request = updated.requests.get(out.req_id)
    if request is not None:
        return request.output_token_ids
    return scheduled.requests[out.req_id].output_token_ids + out.new_token_ids
