"""The engine loop: admit requests, schedule, execute, update, and report finished requests.

The pure core (runtime/core) decides; around it, three parts with one job each: the input processor
(runtime/input_processor.py) validates a request before anything is scheduled, the model runner
executes a step, and the output processor (runtime/output_processor.py) turns the core's outputs
into RequestOutputs and ends requests on stop strings.

The engine holds the current core state and replaces it only when a step has gone through: if
execute fails, the state of before the step stays current (the runner undoes its own changes,
runtime/runner/errors.py), the requests the failure names finish with finish_reason "error", and
the others go on. A failure after the device took the KV cache, or in update, leaves the runner and
the core out of step; the engine then refuses to go on (EngineDeadError) rather than serve from a
cache in an unknown state.

Async scheduling (EngineConfig.async_scheduling, vLLM's AsyncScheduler and batch queue of two):
`step` schedules and dispatches step N+1 while step N still runs on the device, then waits for
N and applies it. The core plans N+1 with N's sampled tokens as placeholders, and the device
feeds them to N+1 itself (runtime/runner/in_flight.py). Commit-after-success holds per step: a
dispatch that fails before the device took the cache leaves the state of before scheduling N+1
(with N still in flight) current; the requests it names finish with an error, N's results for
the others are applied when it is read.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from runtime import host_malloc
from runtime.config import ConfigError, EngineConfig
from runtime.core import scheduler as sched
from runtime.core.kv import kv_cache
from runtime.core.kv_jobs import jobs as kv_jobs
from runtime.core.kv_jobs.scheduler_hooks import enable_kv_jobs, has_pending_kv_jobs
from runtime.core.outputs import SchedulerOutput
from runtime.core.request import FinishReason, PoolingParams, Request, SamplingParams
from runtime.core.scheduling.scheduler_config import SchedulerConfig
from runtime.engine_setup import resolve
from runtime.input_processor import InputProcessor, ProcessedRequest
from runtime.multimodal.image_prompt import ImagePrompt
from runtime.output_processor import OutputProcessor
from runtime.pooling_input_processor import PoolingInputProcessor
from runtime.pooling_output_processor import PoolingOutputProcessor
from runtime.pooling_schedule import whole_prompts
from runtime.request_output import RequestOutput
from runtime.runner.errors import RequestFailed, RunnerLost
from runtime.runner.in_flight import StepInFlight
from runtime.runner.model_runner import ModelRunner
from runtime.runner.pooling_runner import PoolingRunner
from runtime.runner_choice import generate_on_pooling, pooling_on_generate
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine met a failure it cannot undo and serves no more requests (as vLLM's)."""


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
class StepTotals:
    """Counts over the engine's whole life, kept whether or not steps are recorded."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0


class Engine:
    """`record_steps`: keep the last N steps' SchedulerOutputs in `history` and StepStats in
    `stats` (None: every step; 0, the default: none, so a long batch job keeps nothing per step).
    `totals` counts steps and tokens either way."""

    def __init__(self, config: EngineConfig, *, record_steps: int | None = 0) -> None:
        if record_steps is not None and (
            isinstance(record_steps, bool) or not isinstance(record_steps, int) or record_steps < 0
        ):
            raise ConfigError(
                f"record_steps must be None (keep every step), 0 (keep none) or a positive int "
                f"(keep the last N), got {record_steps!r}"
            )
        setup = resolve(config)
        if config.keep_host_buffers:
            host_malloc.keep_freed_buffers()
        config, model_config = setup.config, setup.model_config
        max_model_len, max_batched = setup.max_model_len, setup.max_num_batched_tokens
        enable_prefix_caching = setup.enable_prefix_caching
        self.pooling = model_config.runner_type == "pooling"
        self.config = config
        self.async_scheduling = setup.async_scheduling
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tokenizer = self._load_tokenizer(config.model)
        self.input_processor = InputProcessor(
            model_config, self.tokenizer, max_model_len, max_logprobs=config.max_logprobs
        )
        self.pooling_input = (
            PoolingInputProcessor(
                model_config,
                self.tokenizer,
                max_model_len,
                whole_prompts=whole_prompts(model_config) is not None,
            )
            if self.pooling
            else None
        )
        self.output_processor = (
            PoolingOutputProcessor() if self.pooling else OutputProcessor(self.tokenizer)
        )
        self.runner = (PoolingRunner if self.pooling else ModelRunner)(
            model_config,
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_batched,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_bytes=config.kv_cache_bytes,
            attention_backend=config.attention_backend,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size,
            enable_expert_parallel=config.enable_expert_parallel,
        )
        try:
            scheduler_config = SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                block_size=config.block_size,
                num_blocks=self.runner.num_kv_blocks,
                num_state_slots=self.runner.num_state_slots,
                enable_prefix_caching=enable_prefix_caching,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                policy=config.scheduling_policy,
                encoder_cache_size=config.encoder_cache_size,
                encoder_compute_budget=config.encoder_compute_budget,
                async_scheduling=self.async_scheduling,
            )
        except sched.SchedulerConfigError as err:
            # The pure core cannot raise the project's ConfigError; callers catch that one.
            raise ConfigError(str(err)) from err
        self.state = sched.make_scheduler(scheduler_config)
        # Async scheduling: the dispatched steps not yet applied, oldest first (at most two).
        self._in_flight: deque[tuple[SchedulerOutput, StepInFlight]] = deque()
        self.offloader = self._make_offloader(config)
        if self.offloader is not None:
            self.state = enable_kv_jobs(self.state)
        self.record_steps = record_steps
        self.history: list[SchedulerOutput] = []
        self.stats: list[StepStats] = []
        self.totals = StepTotals()
        # Requests held back until a shared store says how much of their prefix it holds:
        # request id -> (lookup id, request). Lookup ids never repeat, so a late answer for an
        # aborted request is never taken for a later request with the same id.
        self._looking_up: dict[str, tuple[int, Request]] = {}
        self._lookup_ids = itertools.count()
        self._arrival = itertools.count()
        # The failure that ended the engine, if one did.
        self._dead: BaseException | None = None

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
        return self.input_processor.eos_token_ids

    @property
    def num_generated_tokens(self) -> int:
        return self.output_processor.num_generated_tokens

    # -- admission --------------------------------------------------------------------------------

    def process_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        priority: int = 0,
        images: ImagePrompt | None = None,
    ) -> ProcessedRequest:
        """Validate a request (raising an error that names the bad value) without admitting it;
        `params=None` takes the checkpoint's generation defaults. `images`: the prompt's images
        (InputProcessor.image_prompt), whose placeholders `prompt_token_ids` holds."""
        if self.pooling:
            raise ValueError(generate_on_pooling(self.model_config))
        processed = self.input_processor.process(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            priority=priority,
            arrival_time=float(next(self._arrival)),
            images=images,
        )
        return self._check_encoder_fit(processed)

    def _check_encoder_fit(self, processed: ProcessedRequest) -> ProcessedRequest:
        """Refuse an image whose encoder output alone exceeds the encoder cache or the
        encoder compute budget: it could never be encoded."""
        config = self.state.config
        limit = min(config.encoder_cache_size, config.encoder_compute_budget)
        for k, item in enumerate(processed.children[0].mm_inputs):
            if item.num_embeds > limit:
                raise ValueError(
                    f"request {processed.request_id!r}: image {k}'s encoder output is "
                    f"{item.num_embeds} embeddings, more than encoder_cache_size="
                    f"{config.encoder_cache_size} / encoder_compute_budget="
                    f"{config.encoder_compute_budget} hold; raise them to at least "
                    f"{item.num_embeds}"
                )
        return processed

    def process_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: PoolingParams,
        *,
        prompt: str | None = None,
        images: ImagePrompt | None = None,
    ) -> ProcessedRequest:
        """Validate a pooling request (`params` resolved for its task by
        `pooling_input.resolve`) without admitting it; admit it with `add_processed`."""
        if not self.pooling:
            raise ValueError(pooling_on_generate(self.model_config, params.task or "encode"))
        processed = self.pooling_input.process(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            arrival_time=float(next(self._arrival)),
            images=images,
        )
        return self._check_encoder_fit(processed)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.add_processed(
            [
                self.process_request(
                    request_id, prompt_token_ids, params, prompt=prompt, priority=priority
                )
            ]
        )

    def add_processed(self, batch: Sequence[ProcessedRequest]) -> None:
        """Admit processed requests: all of them, or (when one cannot be) none."""
        names: set[str] = set()
        samples: set[str] = set()
        state = self.state
        admitted = []  # (state with the sample added, sample), in order
        for processed in batch:
            rid = processed.request_id
            if rid in names or self.output_processor.has_request(rid):
                raise ValueError(f"request id {rid!r} is in use by an unfinished request")
            names.add(rid)
            for child in processed.children:
                cid = child.request_id
                if cid in samples or cid in self._looking_up:
                    raise ValueError(f"request id {cid!r} is in use by an unfinished request")
                samples.add(cid)
                # The core validates (and hashes) the request; the state is a value, so a trial
                # add costs nothing, and nothing is kept if a later request is refused.
                state = sched.add_request(state, child)
                admitted.append((state, child))
        if self.offloader is not None and self.offloader.store.shared:
            # A shared pool may hold prefixes other engines stored. Asking it can block (a
            # Mooncake master that is down answers after ~4 s), so each request waits for the
            # answer outside the scheduler while the others run (runtime/offload/lookup.py).
            for added, child in admitted:
                cid = child.request_id
                lookup_id = next(self._lookup_ids)
                self._looking_up[cid] = (lookup_id, child)
                self.offloader.submit_lookup((lookup_id, cid), added.requests[cid].block_hashes)
        else:
            self.state = state
        for processed in batch:
            self.output_processor.add(processed)
            if self.runner.encoder_path is not None:
                # The images go to the runner's vision tower; the core holds only their hashes.
                # Every request is handed over, with or without images: the runner counts each
                # admission of an id, which may be reused before it hears the old one finished.
                for child in processed.children:
                    self.runner.encoder_path.add_request(
                        child.request_id, child.mm_inputs, processed.pixel_values
                    )

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort the unfinished requests among `request_ids` (running, waiting, preempted or
        waiting for a KV load), as vLLM's `LLMEngine.abort_request`; ids that already finished or
        were never added are passed over. Returns the aborted requests' final outputs
        (finish_reason "abort"), reported here and never again by `step`."""
        samples = self.output_processor.samples_of(dict.fromkeys(request_ids))
        if not samples:
            return []
        # A request still waiting for its lookup is not in the scheduler yet; its answer, when
        # it comes, is dropped (the lookup id no longer matches).
        for sample in samples:
            self._looking_up.pop(sample, None)
        self.state, outputs = self.output_processor.finish(self.state, samples, FinishReason.ABORT)
        return outputs

    @property
    def num_awaiting_lookup(self) -> int:
        """Requests held back until the shared store answers their prefix lookup."""
        return len(self._looking_up)

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or KV jobs still pinning blocks (their completions arrive only
        with a step, so the loop keeps stepping)."""
        return (
            sched.has_unfinished_requests(self.state)
            or has_pending_kv_jobs(self.state)
            or bool(self._looking_up)
            or bool(self._in_flight)
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

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One schedule / execute / update round; returns the requests that finished in it."""
        if self._dead is not None:
            raise EngineDeadError(
                f"this engine stopped serving after a failure it cannot undo ({self._dead!r}); "
                "build a new one"
            ) from self._dead
        if self.async_scheduling:
            return self._step_async()
        if self.offloader is not None:
            self._admit_looked_up()
        scheduled, scheduler_output, runner_out, failed = self._schedule_and_run(
            self.runner.execute
        )
        if failed is not None:
            return failed
        try:
            results = ()
            if self.offloader is not None:
                # After execute: the blocks a store job gathers hold this step's KV.
                self.offloader.start(self.runner.kv_caches, scheduler_output.kv_jobs)
                idle = scheduler_output.total_num_scheduled_tokens == 0
                self.runner.kv_caches, results = self.offloader.finish(
                    self.runner.kv_caches, wait_s=0.01 if idle else 0.0
                )
            updated, outputs = sched.update(scheduled, scheduler_output, runner_out, results)
            state, finished = self.output_processor.process(scheduled, updated, outputs)
        except Exception as err:
            # The runner went on with this step and the core cannot: the two no longer agree.
            raise self._die(err) from err
        self.state = state
        self._count(scheduled, scheduler_output)
        return finished

    def _step_async(self) -> list[RequestOutput]:
        """vLLM's step_with_batch_queue with a queue of two: schedule and dispatch the next step
        (N+1) while the one before (N) runs; return at once while the queue has room, else
        wait for N, apply it and return the requests that finished in it."""
        queue = self._in_flight
        if sched.has_unfinished_requests(self.state):
            # A failed dispatch left N in the queue and the state of before N+1 current.
            scheduled, scheduler_output, dispatched, failed = self._schedule_and_run(
                self.runner.dispatch
            )
            if failed is not None:
                return failed
            self.state = scheduled
            queue.append((scheduler_output, dispatched))
            self._count(scheduled, scheduler_output)
            executed = scheduler_output.total_num_scheduled_tokens > 0
            if len(queue) < 2 and (executed or sched.has_unfinished_requests(self.state)):
                return []
        elif not queue:
            return []
        scheduler_output, dispatched = queue.popleft()
        try:
            runner_out = self.runner.collect(dispatched)
            updated, outputs = sched.update(self.state, scheduler_output, runner_out)
            state, finished = self.output_processor.process(self.state, updated, outputs)
        except Exception as err:
            # The device ran the step and the core cannot apply it: the two no longer agree.
            raise self._die(err) from err
        self.state = state
        return finished

    def _schedule_and_run(self, run):
        """Schedule a step and hand it to `run` (the runner's execute or dispatch): (the state
        schedule() returned, its output, what `run` returned, None), or, when the runner named
        the requests it failed on, (None, output, None, their final outputs). A failure before
        the device step leaves the runner as before the call, so the current state stays the
        truth (any other exception reaches the caller with it unchanged)."""
        before = self.state
        scheduled, scheduler_output = sched.schedule(before)
        try:
            return scheduled, scheduler_output, run(scheduler_output), None
        except RequestFailed as err:
            return None, scheduler_output, None, self._fail(before, scheduler_output, err)
        except RunnerLost as err:
            raise self._die(err) from err

    def _fail(
        self, before, scheduler_output: SchedulerOutput, err: RequestFailed
    ) -> list[RequestOutput]:
        failed = [r for r in dict.fromkeys(err.request_ids) if sched.has_request(before, r)]
        if not failed:
            raise err
        log.error(
            "step %d failed for %s; they finish with an error: %s",
            scheduler_output.step,
            failed,
            err,
        )
        self.state, outputs = self.output_processor.finish(
            before, failed, FinishReason.ERROR, error=str(err)
        )
        return outputs

    def _die(self, err: BaseException) -> EngineDeadError:
        self._dead = err
        log.error("engine stopped: %r", err)
        return EngineDeadError(
            f"this engine stopped serving: {err!r} left the model runner and the scheduler out "
            "of step; build a new one"
        )

    def _count(self, scheduled, scheduler_output: SchedulerOutput) -> None:
        """`scheduled`: the state schedule() returned with `scheduler_output`. A request decodes
        once it computes from past its prompt, at the position the step was planned from (with
        async scheduling that counts the step in flight)."""
        prefill = decode = 0
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prefill += num_scheduled[new.req_id]
        requests = scheduled.requests
        for cached in scheduler_output.scheduled_cached_reqs:
            n = num_scheduled[cached.req_id]
            if cached.num_computed_tokens >= requests[cached.req_id].num_prompt_tokens:
                decode += n
            else:
                prefill += n
        totals = self.totals
        totals.steps += 1
        totals.prefill_tokens += prefill
        totals.decode_tokens += decode
        totals.preemptions += len(scheduler_output.preempted_req_ids)
        keep = self.record_steps
        if keep == 0:
            return
        self.history.append(scheduler_output)
        self.stats.append(
            StepStats(
                scheduler_output.step,
                prefill,
                decode,
                len(self.state.running),
                len(self.state.waiting),
                len(scheduler_output.preempted_req_ids),
                self.runner.num_kv_blocks - 1 - kv_cache.num_free_blocks(self.state.kv),
            )
        )
        if keep is not None and len(self.history) > keep:
            del self.history[:-keep], self.stats[:-keep]
