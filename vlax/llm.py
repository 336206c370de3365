"""`LLM`: batch offline inference with vLLM's call shapes."""

from __future__ import annotations

import inspect
import itertools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields

from tqdm.auto import tqdm

from runtime.config import EngineConfig
from runtime.core.request import PoolingParams, SamplingParams
from runtime.engine import Engine
from runtime.multimodal.image_processor import PreprocessMemo
from runtime.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from runtime.request_output import RequestOutput
from runtime.runner import warm_up
from runtime.runner_choice import generate_on_pooling
from vlax import arguments, llm_pooling

Prompt = str | Mapping[str, object]


class LLM:
    """An engine over one checkpoint. `model=None` uses the embedded default checkpoint.

    `engine_args` are EngineConfig's knobs. `kv_offload` takes "host" (a shared-memory store of
    `kv_offload_bytes`), "mooncake" (a client of the pool at `mooncake_master`), or a store object
    that implements runtime/offload/store.py's `KVStore` (its docstring states the contract); the
    engine closes the stores it builds, and leaves a store object open for its owner to close.
    `tensor_parallel_size=T` runs the model over T devices (attention and KV heads, MLP
    intermediate and vocabulary split; `enable_expert_parallel=True` splits MoE experts instead of
    their intermediate); with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set,
    every process of the group builds the same LLM and is given the same prompts, and T counts the
    devices of all of them (README: "Two hosts").
    `record_steps` keeps the last N steps' scheduler outputs and stats in `llm.engine.history` /
    `llm.engine.stats` (None: all of them; the default 0: none, so a long job keeps nothing per
    step).
    `compilation_cache=True` turns on JAX's persistent compilation cache in vlax's cache
    directory (vlax/compilation_cache.py), so a second process on the same checkpoint loads its
    compiled steps instead of compiling them; False leaves JAX's settings alone.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        record_steps: int | None = 0,
        compilation_cache: bool = True,
        **engine_args,
    ) -> None:
        arguments.check_keywords("LLM()", engine_args, _accepted_keywords())
        if compilation_cache:
            from vlax import compilation_cache as persistent_cache

            persistent_cache.enable()
        if model is None:
            from vlax.default_model import default_model_path

            model = str(default_model_path())
        model = arguments.checkpoint_dir(model)
        if os.environ.get("JAX_COORDINATOR_ADDRESS"):
            # One process of a multi-host engine: join the group before JAX picks its devices.
            from runtime.runner import multihost

            multihost.initialize()
        self.engine = Engine(
            EngineConfig(model=str(model), **engine_args), record_steps=record_steps
        )
        self._ids = itertools.count()
        # (batch shape, sampler key) pairs compiled up front by generate (warm_up.py).
        self._compiled: set = set()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: vLLM's defaults with the
        checkpoint's generation_config.json sampling values over them."""
        return self.engine.input_processor.default_params

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
        later prompts still run. Stopping early (a break, an exception) aborts the rest.

        The whole batch is validated before any of it is admitted: a bad prompt anywhere raises
        an error naming it, and nothing of the batch runs."""
        if self.engine.pooling:
            raise ValueError(generate_on_pooling(self.engine.model_config))
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = arguments.per_prompt_params(sampling_params, len(prompts))
        engine = self.engine
        batch = []
        memo = PreprocessMemo()  # a picture given in many prompts is preprocessed once
        for prompt, params in zip(prompts, params_list, strict=True):
            request_id = str(next(self._ids))
            # A prompt dict may carry {"multi_modal_data": {"image": ...}}: its placeholders go
            # into the token ids, its pixels to the runner.
            text, built = engine.input_processor.image_prompt(
                prompt, f"request {request_id!r}", memo
            )
            batch.append(
                engine.process_request(
                    request_id, built.token_ids, params, prompt=text, images=built
                )
            )
        engine.add_processed(batch)
        request_ids = [p.request_id for p in batch]
        try:
            self._precompile(batch, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)  # nothing of the batch runs on into the next call
            raise
        yield from self._in_order(request_ids, use_tqdm)

    def _precompile(self, batch: Sequence, use_tqdm: bool) -> None:
        """Compile the batch shapes a dry run of the core plans for the engine's requests, this
        batch just added (runtime/runner/warm_up.py), before the first step, behind a progress
        bar; shapes compiled by an earlier call are skipped. Requests with other sampling flags
        than the first's compile when met."""
        engine = self.engine
        if not batch or not warm_up.compiles_up_front(engine.runner):
            return
        shapes = warm_up.planned_shapes(engine.state, engine.runner.builder)
        params = batch[0].params
        key = warm_up.sampler_key(engine.runner, params)
        todo = [s for s in shapes if (s, key) not in self._compiled]
        if not todo:
            return
        with tqdm(total=len(todo), desc="Compiling batch shapes", disable=not use_tqdm) as bar:

            def done(shape):
                self._compiled.add((shape, key))
                bar.update(1)

            warm_up.precompile(engine.runner, todo, params, done=done)

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

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats), in input order.
        Normalized unless the model or `pooling_params` says otherwise; `dimensions` truncates
        a matryoshka model's embedding (before normalization)."""
        return llm_pooling.embed(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`outputs.probs`) from a classification head: softmax
        over the labels (sigmoid for one label); `use_activation=False` gives the logits."""
        return llm_pooling.classify(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (`outputs.score`), pairs formed 1:1, 1:N or N:N: a cross-encoder's
        probability for the pair, or an embedding model's cosine similarity."""
        return llm_pooling.score(
            self, data_1, data_2, pooling_params, truncate_prompt_tokens, use_tqdm
        )

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str = "token_embed",
    ) -> list[PoolingRequestOutput]:
        """Raw pooled outputs (`outputs.data`, a numpy array). The default task, "token_embed",
        gives every prompt token's final hidden state, [tokens, hidden] (normalized per token
        unless PoolingParams(normalize=False)); "embed" and "classify" give those tasks' arrays."""
        return llm_pooling.run_pooling(
            self, prompts, pooling_task, "encode", pooling_params, truncate_prompt_tokens, use_tqdm
        )

    def _in_order(self, request_ids: list[str], use_tqdm: bool) -> Iterator[RequestOutput]:
        finished: dict[str, RequestOutput] = {}  # finished, waiting for the ones before them
        done = 0  # outputs yielded so far
        try:
            for outputs in self._steps(len(request_ids), use_tqdm):
                finished.update((o.request_id, o) for o in outputs)
                while done < len(request_ids) and request_ids[done] in finished:
                    out = finished.pop(request_ids[done])
                    done += 1
                    yield out
            if done < len(request_ids):
                raise RuntimeError(
                    f"the engine went idle before requests {request_ids[done:]} finished"
                )
        except BaseException:
            # The caller stopped early (or a step failed): the rest must not run on into the
            # next call.
            self.engine.abort_request(request_ids[done:])
            raise

    def _steps(self, total: int, use_tqdm: bool) -> Iterator[list[RequestOutput]]:
        """Steps the engine until it is idle, yielding the requests each step finished."""
        engine = self.engine
        bar = tqdm(total=total, desc="Processed prompts", unit="req", disable=not use_tqdm)
        # A pooling engine generates nothing: its rate is of the prompt tokens it pooled.
        kind = "input" if engine.pooling else "output"
        counted = (
            (lambda: engine.output_processor.num_pooled_tokens)
            if engine.pooling
            else (lambda: engine.num_generated_tokens)
        )
        start, first = time.perf_counter(), counted()
        with bar:
            while engine.has_unfinished_requests():
                finished = engine.step()
                if finished:
                    bar.update(len(finished))
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    rate = (counted() - first) / elapsed
                    bar.set_postfix_str(f"{kind} {rate:.1f} tok/s")
                    yield finished


def _accepted_keywords() -> list[str]:
    """Every keyword `LLM()` takes: its own and EngineConfig's knobs."""
    own = [
        p.name
        for p in inspect.signature(LLM.__init__).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "model")
    ]
    return own + [f.name for f in fields(EngineConfig) if f.name != "model"]
