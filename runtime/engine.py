"""The engine loop: add requests, schedule, execute, update, detokenize, and report outputs.

The scheduler state is a pure value; the engine holds the current one, hands each SchedulerOutput to
the model runner, and feeds the runner's output back into `update`. Stop strings are found here, in
the detokenizer, and turned into a pure `finish_requests` transition.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace

from model.config import ModelConfig
from runtime.config import ConfigError, EngineConfig
from runtime.core import kv_cache, kv_jobs
from runtime.core import scheduler as sched
from runtime.core.outputs import EngineCoreOutput, LogprobsEntry, SchedulerOutput
from runtime.core.request import FinishReason, Request, SamplingParams
from runtime.core.scheduler_config import SchedulerConfig
from runtime.core.scheduler_kv_jobs import enable_kv_jobs, has_pending_kv_jobs
from runtime.detokenizer import IncrementalDetokenizer
from runtime.runner.model_runner import ModelRunner
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class StepStats:
    step: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_blocks_used: int


@dataclass
class TrackedRequest:
    """Engine-side view of one request: its text so far, logprobs, and how it ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobsEntry] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "" if self.detok is None else self.detok.output_text


class Engine:
    def __init__(self, config: EngineConfig, *, record: bool = False) -> None:
        self.config = config
        mc = ModelConfig.from_pretrained(config.model, dtype=config.dtype)
        if mc.runner_type != "generate":
            raise ConfigError(
                f"{config.model}: {mc.architecture} is a {mc.runner_type} model; "
                "generation needs a generative (causal LM) checkpoint"
            )
        max_model_len = config.max_model_len or mc.max_model_len
        if max_model_len > mc.max_model_len:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the checkpoint's "
                f"max_position_embeddings={mc.max_model_len}"
            )
        max_batched = config.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS
            if config.enable_chunked_prefill
            else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        )
        if not config.enable_chunked_prefill and max_batched < max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens={max_batched} must be at least "
                f"max_model_len={max_model_len}, or a long prompt could never be scheduled"
            )
        self.model_config = mc
        self.max_model_len = max_model_len
        self.tokenizer = self._load_tokenizer(config.model)
        self.runner = ModelRunner(
            mc,
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_batched,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_bytes=config.kv_cache_bytes,
            attention_backend=config.attention_backend,
            seed=config.seed,
        )
        self.state = sched.make_scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                block_size=config.block_size,
                num_blocks=self.runner.num_kv_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                policy=config.scheduling_policy,
            )
        )
        self.offloader = self._make_offloader(config)
        if self.offloader is not None:
            self.state = enable_kv_jobs(self.state)
        self.record = record
        self.history: list[SchedulerOutput] = []
        self.stats: list[StepStats] = []
        self.tracked: dict[str, TrackedRequest] = {}
        # Requests held back until a shared store says how much of their prefix it holds:
        # request id -> (lookup id, request). Lookup ids never repeat, so a late answer for an
        # aborted request is never taken for a later request with the same id.
        self._looking_up: dict[str, tuple[int, Request]] = {}
        self._lookup_ids = itertools.count()
        self._arrival = itertools.count()
        self.num_generated_tokens = 0

    def _make_offloader(self, config: EngineConfig):
        """The KV offloader over the store `kv_offload` names (built here, closed with the
        engine) or is (a KVStore object: checked against this engine's block size, left open)."""
        if config.kv_offload is None:
            return None
        from runtime.offload.device_copy import block_nbytes
        from runtime.offload.offloader import KVOffloader, make_store
        from runtime.offload.store import check_store

        if not isinstance(config.kv_offload, str):
            nbytes = block_nbytes(self.runner.kv_caches)
            try:
                store = check_store(config.kv_offload, nbytes)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            return KVOffloader(store, owns_store=False)
        store = make_store(
            config.kv_offload,
            self.runner.kv_caches,
            kv_offload_bytes=config.kv_offload_bytes,
            mooncake_master=config.mooncake_master,
            namespace=f"{self.model_config.path}:{self.runner.kv_dtype}:{config.block_size}",
        )
        return KVOffloader(store)

    @staticmethod
    def _load_tokenizer(path: str) -> Tokenizer | None:
        try:
            return Tokenizer.from_pretrained(path)
        except Exception as e:  # a checkpoint without tokenizer still serves token-id prompts
            log.warning("no tokenizer loaded from %s (%s); prompts must be token ids", path, e)
            return None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id: the checkpoint config's, generation_config.json's, the tokenizer's."""
        found = self.model_config.hf_config.get("eos_token_id")
        config = () if found is None else (tuple(found) if not isinstance(found, int) else (found,))
        tok = (
            ()
            if self.tokenizer is None or self.tokenizer.eos_token_id is None
            else (self.tokenizer.eos_token_id,)
        )
        return tuple(dict.fromkeys(config + self.model_config.eos_token_ids + tok))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: prompt token id {bad[0]} is outside the vocabulary "
                f"[0, {vocab})"
            )
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=float(next(self._arrival)),
            priority=priority,
        )
        if request_id in self._looking_up:
            raise sched.SchedulerError(
                f"add_request: request id {request_id!r} is in use by an unfinished request"
            )
        # The core validates (and hashes) the request; the state is a value, so a trial add
        # costs nothing when the request has to wait for its lookup first.
        added = sched.add_request(self.state, request)
        if self.offloader is not None and self.offloader.store.shared:
            # A shared pool may hold prefixes other engines stored. Asking it can block (a
            # Mooncake master that is down answers after ~4 s), so the request waits for the
            # answer outside the scheduler while the others run (runtime/offload/lookup.py).
            lookup_id = next(self._lookup_ids)
            self._looking_up[request_id] = (lookup_id, request)
            self.offloader.submit_lookup(
                (lookup_id, request_id), added.requests[request_id].block_hashes
            )
        else:
            self.state = added
        detok = (
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids)
        )
        self.tracked[request_id] = TrackedRequest(
            request_id, prompt, list(prompt_token_ids), params, detok
        )

    def abort_request(self, request_ids) -> list[TrackedRequest]:
        """Abort the unfinished requests among `request_ids` (running, waiting, preempted or
        waiting for a KV load), as vLLM's `LLMEngine.abort_request`; ids that already finished or
        were never added are passed over. Returns the aborted requests: their final outputs
        (finish_reason ABORT), reported here and never again by `step`."""
        request_ids = list(
            dict.fromkeys(
                r for r in request_ids if sched.has_request(self.state, r) or r in self._looking_up
            )
        )
        # A request still waiting for its lookup is not in the scheduler yet; its answer, when
        # it comes, is dropped (the lookup id no longer matches).
        in_core = [r for r in request_ids if self._looking_up.pop(r, None) is None]
        self.state = sched.abort_requests(self.state, in_core)
        aborted = []
        for rid in request_ids:
            tracked = self.tracked[rid]
            tracked.finish_reason, tracked.stop_reason = FinishReason.ABORT, None
            aborted.append(tracked)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or KV jobs still pinning blocks (their completions arrive only
        with a step, so the loop keeps stepping)."""
        return (
            sched.has_unfinished_requests(self.state)
            or has_pending_kv_jobs(self.state)
            or bool(self._looking_up)
        )

    @property
    def offload_stats(self):
        return None if self.state.kv_jobs is None else self.state.kv_jobs.stats

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None

    def _admit_looked_up(self) -> None:
        """Hand the requests whose store lookup has answered to the scheduler, in arrival
        order, noting what the store holds. With nothing else to run, wait a little for one."""
        idle = not sched.has_unfinished_requests(self.state)
        wait_s = 0.01 if idle and self._looking_up else 0.0
        for answer in self.offloader.take_lookups(wait_s):
            if answer.found:
                # True of the store whether or not the request is still waiting for it.
                self.state = replace(
                    self.state, kv_jobs=kv_jobs.note_stored(self.state.kv_jobs, answer.found)
                )
            lookup_id, request_id = answer.token
            held = self._looking_up.get(request_id)
            if held is not None and held[0] == lookup_id:
                del self._looking_up[request_id]
                self.state = sched.add_request(self.state, held[1])

    def step(self) -> list[TrackedRequest]:
        """One schedule / execute / update round; returns the requests that finished in it."""
        if self.offloader is not None:
            self._admit_looked_up()
        before = self.state
        self.state, so = sched.schedule(self.state)
        runner_out = self.runner.execute(so)
        results = ()
        if self.offloader is not None:
            # After execute: the blocks a store job gathers hold this step's KV.
            self.offloader.start(self.runner.kv_caches, so.kv_jobs)
            idle = so.total_num_scheduled_tokens == 0
            self.runner.kv_caches, results = self.offloader.finish(
                self.runner.kv_caches, wait_s=0.01 if idle else 0.0
            )
        self.state, outputs = sched.update(self.state, so, runner_out, results)
        if self.record:
            self.history.append(so)
        self._record_stats(before, so)
        return self._process(outputs)

    def _record_stats(self, before, so: SchedulerOutput) -> None:
        prefill = decode = 0
        for rid, n in so.num_scheduled_tokens.items():
            req = before.requests.get(rid)
            if req is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                decode += n
            else:
                prefill += n
        self.stats.append(
            StepStats(
                so.step,
                prefill,
                decode,
                len(self.state.running),
                len(self.state.waiting),
                len(so.preempted_req_ids),
                self.runner.num_kv_blocks - 1 - kv_cache.num_free_blocks(self.state.kv),
            )
        )

    def _process(self, outputs: tuple[EngineCoreOutput, ...]) -> list[TrackedRequest]:
        done, stop_hits = [], []
        for out in outputs:
            tr = self.tracked[out.req_id]
            tr.token_ids.extend(out.new_token_ids)
            self.num_generated_tokens += len(out.new_token_ids)
            if out.new_logprobs is not None:
                tr.logprobs.append(out.new_logprobs)
            if out.new_prompt_logprobs is not None:
                tr.prompt_logprobs.append(out.new_prompt_logprobs)
            stop_str = None
            if tr.detok is not None:
                stop_token = out.finish_reason is FinishReason.STOP and isinstance(
                    out.stop_reason, int
                )
                stop_str = tr.detok.update(
                    out.new_token_ids, stop_terminated=stop_token, finished=out.finished
                )
            if stop_str is not None:
                tr.finish_reason, tr.stop_reason = FinishReason.STOP, stop_str
                if not out.finished:
                    stop_hits.append(out.req_id)
                done.append(tr)
            elif out.finished:
                tr.finish_reason, tr.stop_reason = out.finish_reason, out.stop_reason
                done.append(tr)
        if stop_hits:
            self.state = sched.finish_requests(self.state, stop_hits, FinishReason.STOP)
        return done
