"""`LLM`: batch offline inference with vLLM's call shapes."""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields, replace

from tqdm.auto import tqdm

from runtime.config import EngineConfig
from runtime.core.outputs import LogprobsEntry
from runtime.core.request import SamplingParams
from runtime.engine import Engine, TrackedRequest
from vlax import arguments
from vlax.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

Prompt = str | Mapping[str, object]


class LLM:
    """An engine over one checkpoint. `model=None` uses the embedded default checkpoint.

    `engine_args` are EngineConfig's knobs. `kv_offload` takes "host" (a shared-memory store of
    `kv_offload_bytes`), "mooncake" (a client of the pool at `mooncake_master`), or a store object
    that implements runtime/offload/store.py's `KVStore` (its docstring states the contract); the
    engine closes the stores it builds, and leaves a store object open for its owner to close.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        arguments.check_keywords("LLM()", engine_args, _accepted_keywords())
        if model is None:
            from vlax.default_model import default_model_path

            model = str(default_model_path())
        model = arguments.checkpoint_dir(model)
        self.engine = Engine(EngineConfig(model=str(model), **engine_args), record=True)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompt_token_ids")
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._prompt_ids(str(prompt["prompt"]))
        raise TypeError(
            f"a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}"
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        return list(self.generate_iter(prompts, sampling_params, use_tqdm))

    def generate_iter(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> Iterator[RequestOutput]:
        """`generate`, one prompt at a time: yields each prompt's RequestOutput in input order as
        soon as it and every prompt before it have finished, so a caller can print or save while
        later prompts still run. Stopping early (a break, an exception) aborts the rest."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = arguments.per_prompt_params(sampling_params, len(prompts))
        groups = []  # (request id, prompt text, prompt ids, child ids)
        for prompt, params in zip(prompts, params_list, strict=True):
            text, ids = self._prompt_ids(prompt)
            rid = str(next(self._ids))
            children = []
            for i in range(params.n):
                child_params = params
                if params.n > 1:
                    seed = None if params.seed is None else params.seed + i
                    child_params = replace(params, n=1, seed=seed)
                cid = rid if params.n == 1 else f"{rid}.{i}"
                self.engine.add_request(cid, ids, child_params, prompt=text)
                children.append(cid)
            groups.append((rid, text, ids, children))
        yield from self._in_order(groups, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, object]] | Sequence[Sequence[Mapping[str, object]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if self.engine.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = []
        for conv in conversations:
            text = self.engine.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _in_order(self, groups, use_tqdm: bool) -> Iterator[RequestOutput]:
        unfinished = {c for g in groups for c in g[3]}
        done = 0  # groups yielded so far
        try:
            for finished in self._steps(len(unfinished), use_tqdm):
                unfinished.difference_update(t.request_id for t in finished)
                while done < len(groups) and unfinished.isdisjoint(groups[done][3]):
                    out = self._request_output(*groups[done])
                    done += 1
                    yield out
            while done < len(groups):  # the engine ran dry: what is left ended without a step
                out = self._request_output(*groups[done])
                done += 1
                yield out
        except BaseException:
            # The caller stopped early: the rest must not run on into the next call.
            left = [c for g in groups[done:] for c in g[3]]
            self.engine.abort_request(left)
            for c in left:
                self.engine.tracked.pop(c, None)
            raise

    def _steps(self, total: int, use_tqdm: bool) -> Iterator[list[TrackedRequest]]:
        """Steps the engine until it is idle, yielding the requests each step finished."""
        engine = self.engine
        bar = tqdm(total=total, desc="Processed prompts", unit="req", disable=not use_tqdm)
        start, first = time.perf_counter(), engine.num_generated_tokens
        with bar:
            while engine.has_unfinished_requests():
                finished = engine.step()
                if finished:
                    bar.update(len(finished))
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    rate = (engine.num_generated_tokens - first) / elapsed
                    bar.set_postfix_str(f"output {rate:.1f} tok/s")
                    yield finished

    def _request_output(self, rid, text, ids, children) -> RequestOutput:
        tracked = [self.engine.tracked.pop(c) for c in children]
        completions = [_completion(i, t, self.engine.tokenizer) for i, t in enumerate(tracked)]
        return RequestOutput(
            request_id=rid,
            prompt=text,
            prompt_token_ids=list(ids),
            prompt_logprobs=_prompt_logprobs(tracked[0], self.engine.tokenizer),
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
        )


def _positions(entry: LogprobsEntry, tokenizer) -> list[PositionLogprobs]:
    out = []
    for ids, lps, rank in zip(
        entry.token_ids, entry.logprobs, entry.sampled_token_ranks, strict=True
    ):
        pos: PositionLogprobs = {}
        # Column 0 is the sampled (or actual next) token, then the top-k in rank order.
        for col, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
            if tid in pos:
                continue
            decoded = (
                None if tokenizer is None else tokenizer.decode([tid], skip_special_tokens=False)
            )
            pos[tid] = Logprob(lp, rank if col == 0 else col, decoded)
        out.append(pos)
    return out


def _completion(index: int, t: TrackedRequest, tokenizer) -> CompletionOutput:
    logprobs = None
    cumulative = None
    if t.params.logprobs is not None:
        logprobs = [p for e in t.logprobs for p in _positions(e, tokenizer)][: len(t.token_ids)]
        cumulative = sum(p[tok].logprob for p, tok in zip(logprobs, t.token_ids, strict=False))
    return CompletionOutput(
        index=index,
        text=t.text,
        token_ids=list(t.token_ids),
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=None if t.finish_reason is None else t.finish_reason.name.lower(),
        stop_reason=t.stop_reason,
    )


def _prompt_logprobs(t: TrackedRequest, tokenizer) -> list[PositionLogprobs | None] | None:
    if t.params.prompt_logprobs is None:
        return None
    return [None] + [p for e in t.prompt_logprobs for p in _positions(e, tokenizer)]


def _accepted_keywords() -> list[str]:
    """Every keyword `LLM()` takes: its own and EngineConfig's knobs."""
    own = [
        p.name
        for p in inspect.signature(LLM.__init__).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "model")
    ]
    return own + [f.name for f in fields(EngineConfig) if f.name != "model"]
