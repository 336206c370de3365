"""The model runner: owns the weights and the KV cache arrays, and runs one jitted step per schedule.

The step is a pure function `(graphdef, params, kv_caches, batch, sampling) -> (kv_caches, tokens)`;
the weights are arguments (never closed over) and the KV cache is donated, so it is updated in place.
Everything mutable here is shell state: the device arrays and a mirror of each live request's tokens
and block table, kept in step with the scheduler's outputs.

A model with recurrent state (state cache specs) also keeps its state pools in the cache value,
donated with the rest: one slot per sequence that may run plus a scratch row for padding rows
(runtime/runner/cache_budget.py). The core names each scheduled request's slot and the slots that
start fresh; the batch carries both (inputs.py), and the model reads zeros for a fresh slot.

The runner knows no model family: it finds the checkpoint's family through model/registry.py and uses
only the protocol of model/base.py (build options, cache specs, forward, compute_logits). Kernel
choices are made once, when the family is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from functools import partial

import immutables
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import base, registry
from model.base import ModelOptions, compute_logits, forward
from model.batch import ModelBatch
from model.config import ModelConfig
from model.layers import compute
from model.loader import LoadError, list_tensors, load_model
from model.sharding import replicated
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.backends import BackendError
from pallas_kernels.platform import current_platform
from pallas_kernels.ragged_paged_attention import decode as rpa_decode
from runtime.core.outputs import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from runtime.multimodal.image_prompt import image_spec
from runtime.runner import cpu_bf16, host_cache, multihost, parallel, request_rows
from runtime.runner.cache_budget import CacheSize, plan_cache
from runtime.runner.cache_budget import KVCacheSizeError as KVCacheSizeError  # raised from here
from runtime.runner.encoder_path import EncoderPath
from runtime.runner.errors import RequestFailed, RunnerLost
from runtime.runner.in_flight import StepInFlight, placeholder
from runtime.runner.inputs import BatchBuilder, HostBatch, RequestRow
from runtime.runner.sampler import compute_prompt_logprobs, sample
from runtime.runner.sampling_metadata import SamplingRow, logprobs_bucket, make_sampling_metadata

log = logging.getLogger(__name__)


@partial(jax.jit, static_argnames=("num_logprobs", "want_hidden"), donate_argnums=(2,))
def _step(graphdef, params, kv_caches, batch, metadata, last_sampled, *, num_logprobs, want_hidden):
    # A token the host does not know yet (async scheduling) is the placeholder -1 - i: the token
    # the step before sampled in its row i, which `last_sampled` holds on the device
    # (runtime/runner/in_flight.py).
    tokens = batch.token_ids
    row = jnp.clip(-1 - tokens, 0, last_sampled.shape[0] - 1)
    batch = batch.replace(token_ids=jnp.where(tokens < 0, last_sampled[row], tokens))
    if want_hidden or tokens.shape[0] == batch.logits_indices.shape[0]:
        kv_caches, hidden = forward(graphdef, params, kv_caches, batch)
        rows = hidden[batch.logits_indices]
    else:
        # Only the sampled rows' final state is read: the last layer's MLP runs on those alone
        # (the multimodal benchmark's 4080-token prefill steps: ~1/8 of their MLP work).
        kv_caches, rows = forward(graphdef, params, kv_caches, batch, batch.logits_indices)
        hidden = None
    # Gathered once, whole on every device, under tensor parallelism (vocab-split LM head).
    logits = replicated(compute_logits(graphdef, params, rows))
    out = replicated(sample(logits, metadata, num_logprobs))
    # Padded to one width, so the next step compiles the same program whatever this one's rows.
    sampled = jnp.zeros_like(last_sampled).at[: out.token_ids.shape[0]].set(out.token_ids)
    return kv_caches, out, (hidden if want_hidden else None), sampled


@partial(jax.jit, static_argnames=("num_logprobs",))
def _prompt_logprobs(graphdef, params, hidden_rows, next_ids, *, num_logprobs):
    return compute_prompt_logprobs(
        replicated(compute_logits(graphdef, params, hidden_rows)), next_ids, num_logprobs
    )


def _taken(caches) -> bool:
    """Whether a jitted call took (donated and deleted) these cache arrays."""
    return any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(caches))


def _decode_chunk_blocks(backends: dict, block_size: int) -> int:
    """Blocks per live KV chunk for the builder when the model's paged attention runs the jnp
    path, which attends only a decode step's live chunks; 0 (no chunk count, no extra shapes)
    for any other kernel or a model without that attention."""
    choice = backends.get(rpa.OP)
    return rpa_decode.chunk_blocks(block_size) if choice and choice.impl == "reference" else 0


def cache_dtype(model_dtype: str, attention_backend: str, head_dim: int | None) -> str:
    """The dtype the runner asks a family to keep its caches in.

    On the CPU a bf16 model's cache dtype is chosen per host, from the CPU's bf16 support and
    whether the C++ attention and write kernels built, and logged with its reason
    (runner/cpu_bf16.py): bf16 where those kernels read and write the pages in place, else f32
    (XLA:CPU moves bf16 through gathers and scatters slowly, and bf16 keys and values are exact in
    f32, so the numbers are the same at twice the memory). A forced kernel keeps the model's
    dtype. "auto" never picks an interpret-mode kernel, so on the CPU it means the jnp path.
    `head_dim`: the head dim of the model's attention K/V pools, which the kernels are built for
    (`attention_head_dim`; None where it keeps none).
    """
    if (
        model_dtype == "bfloat16"
        and current_platform() == "cpu"
        and attention_backend in ("auto", "reference")
    ):
        return cpu_bf16.host_choice(head_dim).cache_dtype
    return model_dtype


def model_options(
    model_config: ModelConfig, block_size: int, attention_backend: str
) -> ModelOptions:
    """What the runner tells a family beside its checkpoint's config. On the CPU it also sets the
    most bytes one intermediate activation takes (the last-level cache: runner/host_cache.py),
    and for a bf16 model there what this process computes bf16 operands in, before the model is
    built and traced (per host, runner/cpu_bf16.py; the layers read both:
    model/layers/compute.py), with the dense weights kept bf16 until `choose_weight_dtype` says
    otherwise."""
    head_dim = None  # read (from the family's cache specs) only where a choice depends on it
    if current_platform() == "cpu":
        compute.limit_activation_bytes(host_cache.activation_limit())
        if model_config.dtype == "bfloat16":
            head_dim = attention_head_dim(model_config, block_size)
            compute.widen_bf16(cpu_bf16.host_choice(head_dim).compute_dtype == "float32")
    return ModelOptions(
        block_size=block_size,
        cache_dtype=cache_dtype(model_config.dtype, attention_backend, head_dim),
        attention_backend=attention_backend,
    )


def choose_weight_dtype(model_config: ModelConfig, cache_bytes: int) -> None:
    """Where this process widens a bf16 model's operands (`model_options`), whether its dense
    weights are kept in f32, once the caches' bytes (`cache_bytes`, the runner's plan) are known:
    the f32 copy must fit beside them (cpu_bf16.keep_weights_wide). Logged; read by the modules
    when they are built."""
    if model_config.dtype != "bfloat16" or current_platform() != "cpu" or not compute.widening():
        return
    wide, why = cpu_bf16.keep_weights_wide(
        _num_weights(model_config.path), cpu_bf16.available_memory(), cache_bytes
    )
    log.info("bfloat16 weights kept in %s: %s", "float32" if wide else "bfloat16", why)
    compute.widen_bf16(True, weights=wide)


def attention_head_dim(model_config: ModelConfig, block_size: int) -> int | None:
    """The head dim of the model's paged attention K/V pools (parts k and v), the one the C++
    attention kernels would be built for; None where it keeps no such pool (MLA latents, DSA
    keys, encoders) or pools of several head dims. Read from the family's cache specs, which own
    what a model caches: its config's head_dim is no guide (DeepSeek's is the rope part)."""
    specs = model_cache_specs(model_config, ModelOptions(block_size=block_size))
    dims = {s.page_shape[-1] for s in base.paged_specs(specs) if s.parts == ("k", "v")}
    return dims.pop() if len(dims) == 1 else None


def _num_weights(path: str) -> int | None:
    """The parameters stored in the checkpoint at `path`; None without one (loading says why)."""
    try:
        return sum(math.prod(t.shape) for t in list_tensors(path).values())
    except (LoadError, OSError):
        return None


def model_cache_specs(model_config: ModelConfig, options: ModelOptions) -> tuple:
    """The checkpoint's family's cache specs (from its config alone: nothing is loaded)."""
    return registry.model_class(model_config.architecture).cache_specs(model_config, options)


def bookkeeping_blocks(
    block_size: int, max_model_len: int, max_num_seqs: int, num_kv_blocks: int | None
) -> CacheSize:
    """The blocks of a family that keeps nothing per token (an encoder: no cache specs). They
    hold no memory: the scheduler's accounting only, enough for max_num_seqs whole requests
    unless num_kv_blocks says otherwise."""
    if num_kv_blocks is None:
        num_kv_blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    return CacheSize(num_kv_blocks, 0, 0, 0)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        attention_backend: str = "auto",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
    ) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.seed = seed
        # The devices this engine runs on and how its arrays sit there (None: one device).
        self.placement = parallel.placement(
            model_config, tensor_parallel_size, enable_expert_parallel
        )
        options = dataclasses.replace(
            model_options(model_config, block_size, attention_backend),
            expert_parallel=enable_expert_parallel,
        )
        self.kv_dtype = options.cache_dtype
        self.cache_specs = model_cache_specs(model_config, options)
        size = (
            plan_cache(self.cache_specs, max_model_len, max_num_seqs, num_kv_blocks, kv_cache_bytes)
            if self.cache_specs
            else bookkeeping_blocks(block_size, max_model_len, max_num_seqs, num_kv_blocks)
        )
        self.num_kv_blocks = size.num_blocks
        # One slot per sequence that may run (0: the model keeps no recurrent state); the state
        # pools hold one more row, the scratch slot of the batch's padding rows.
        self.num_state_slots = size.num_state_slots
        self.kv_cache_bytes = size.kv_bytes
        self.state_cache_bytes = size.state_bytes
        choose_weight_dtype(model_config, size.kv_bytes + size.state_bytes)
        try:
            self.graphdef, self.params = load_model(
                model_config.path,
                model_config,
                options,
                place=None if self.placement is None else self.placement.weight,
            )
        except BackendError as e:
            raise BackendError(
                f"attention_backend={attention_backend!r} for {model_config.architecture} at "
                f"block_size={block_size}, cache dtype {self.kv_dtype}: {e}"
            ) from e
        # The kernel choices the family made (and logged) when it was built, by op.
        model = nnx.merge(self.graphdef, self.params)
        self.backends = {choice.op: choice for choice in model.backends}
        if self.placement is None:
            self.kv_caches = base.allocate(
                self.cache_specs, self.num_kv_blocks, self.num_state_slots
            )
        else:
            self.kv_caches = self.placement.allocate(
                self.cache_specs, self.num_kv_blocks, self.num_state_slots
            )
        log.info(
            "KV cache: %s",
            base.describe(self.cache_specs, self.num_kv_blocks, self.num_state_slots)
            if self.cache_specs
            else f"none ({model_config.architecture} keeps nothing per token; its "
            f"{self.num_kv_blocks} blocks are the scheduler's bookkeeping only)",
        )
        log.info("memory per device: %s", parallel.memory_report(self.params, self.kv_caches))
        # The image models (PaliGemma, ColPali) pass each sequence a bidirectional prefix, which
        # the jnp path's tiles do not serve: their steps keep table-width buckets.
        spec = image_spec(model_config.architecture, model_config.hf_config, model_config.path)
        self.builder = BatchBuilder(
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_state_slots=self.num_state_slots,
            decode_chunk_blocks=_decode_chunk_blocks(self.backends, block_size),
            tiled_steps=spec is None,
        )
        self.rows: dict[str, RequestRow] = {}
        # The newest dispatched step not yet read back, and its sampled ids on the device (padded
        # to the widest batch), which feed the placeholders of the next step (in_flight.py).
        self._unread: StepInFlight | None = None
        self._last_sampled = np.zeros(self.builder.seq_buckets[-1], np.int32)
        # A vision-language model's encoder outputs and their placeholder rows (None: text only).
        self.encoder_path = (
            None
            if spec is None
            else EncoderPath(
                self.graphdef,
                self.params,
                image_size=spec.image_size,
                num_image_tokens=spec.num_image_tokens,
            )
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it (synchronous scheduling): `collect(dispatch(...))`."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput) -> StepInFlight:
        """Start one step on the device and return without waiting for it. If it raises before
        the device step took the KV cache, the runner is as it was before the call
        (runtime/runner/errors.py says what each failure means). At most one earlier step may be
        in flight: the rows it samples feed this step from the device (in_flight.py)."""
        # Several processes: all of them are about to run this same step, or all stop here.
        multihost.check_agreement(scheduler_output)
        order, undo = request_rows.apply(self.rows, scheduler_output)
        if not order:
            if self.encoder_path is not None:
                self.encoder_path.end_step(scheduler_output)
            empty = ModelRunnerOutput(req_ids=(), sampled_token_ids=())
            return StepInFlight(scheduler_output.step, (), output=empty)
        caches = self.kv_caches
        try:
            # Every jitted call of the step traces under the engine's mesh (the model's layers
            # read it: model/sharding.py); subclasses' _launch too.
            with self._on_mesh():
                step = self._launch(scheduler_output, order)
            if self.encoder_path is not None:
                self.encoder_path.end_step(scheduler_output)
            return step
        except RunnerLost:
            raise
        except Exception as err:
            if self.kv_caches is caches and not _taken(caches):
                request_rows.undo(self.rows, undo)
                if self.encoder_path is not None:
                    self.encoder_path.undo_step()
                raise
            raise RunnerLost(
                f"step {scheduler_output.step}: the device step failed after it took the KV cache ({err!r}); "
                "this runner cannot serve any more requests"
            ) from err

    def collect(self, step: StepInFlight) -> ModelRunnerOutput:
        """Wait for a dispatched step and return its output (once read, kept: collecting twice
        returns the same output). A failure here is the device's, after it took the KV cache."""
        if step.output is None:
            try:
                with self._on_mesh():
                    step.output = self._read_back(step)
            except Exception as err:
                raise RunnerLost(
                    f"step {step.step}: reading the device step's results failed ({err!r}); "
                    "this runner cannot serve any more requests"
                ) from err
        if self._unread is step:
            self._unread = None
        return step.output

    def _launch(self, scheduler_output: SchedulerOutput, order: list[str]) -> StepInFlight:
        want_prompt = frozenset(
            r
            for r in order
            if self.rows[r].sampling_params.prompt_logprobs is not None
            and self.rows[r].num_prompt_logprobs_done < self.rows[r].prompt_len - 1
        )
        skipped = [
            r
            for r in want_prompt
            if self.rows[r].num_computed_tokens > self.rows[r].num_prompt_logprobs_done
        ]
        if skipped:
            row = self.rows[skipped[0]]
            raise RequestFailed(
                skipped,
                f"request {row.req_id!r} asks for prompt logprobs but computes from prompt "
                f"position {row.num_computed_tokens}: the logprobs of positions "
                f"{row.num_prompt_logprobs_done}..{row.num_computed_tokens - 1} were never "
                "computed (a prefix-cache hit or KV load must not skip its prompt)",
            )
        host_batch = self.builder.build(
            self.rows,
            scheduler_output.num_scheduled_tokens,
            order,
            want_prompt_logprobs=want_prompt,
            state_slots=scheduler_output.state_slots,
            reset_state_slots=scheduler_output.reset_state_slots,
        )
        sampling = [self.rows[r] for r in host_batch.sampling_req_ids]
        if self._unread is not None and any(_needs_values(r.sampling_params) for r in sampling):
            # Penalties and bad words read the tokens themselves, not only their count: the
            # step in flight's tokens are read back first (this step is then synchronous).
            self.collect(self._unread)
        vocab = self.model_config.vocab_size
        counts = [r.sampling_params.num_logprobs for r in sampling]
        k = logprobs_bucket(max((n for n in counts if n is not None), default=None), vocab)
        metadata = make_sampling_metadata(
            [self._sampling_row(r) for r in sampling],
            num_rows=host_batch.arrays["logits_indices"].shape[0],
            vocab_size=vocab,
            global_seed=self.seed,
            step=scheduler_output.step,
        )
        # Host arrays go to the jitted step as they are: the call transfers them in its C++
        # dispatch (jnp.asarray on each one first cost ~80 us apiece, most of a decode step's
        # host time).
        batch = ModelBatch(
            **host_batch.arrays,
            decode_chunks=host_batch.decode_chunks,
            tile_chunks=host_batch.tile_chunks,
            **self._multimodal(scheduler_output, host_batch),
        )
        last_sampled = self._last_sampled
        if self.placement is not None:
            batch, metadata = self.placement.host_inputs((batch, metadata))
            if isinstance(last_sampled, np.ndarray):
                last_sampled = self.placement.host_inputs(last_sampled)
        self.kv_caches, out, hidden, self._last_sampled = _step(
            self.graphdef,
            self.params,
            self.kv_caches,
            batch,
            metadata,
            last_sampled,
            num_logprobs=k,
            want_hidden=bool(host_batch.prompt_logprob_rows),
        )
        step = StepInFlight(
            scheduler_output.step,
            tuple(order),
            host_batch.sampling_req_ids,
            out,
            sampling,
            k,
            self._prompt_logprobs(host_batch, hidden) if hidden is not None else None,
        )
        # Each sampling row's next token, known on the device only until the step is read.
        for i, row in enumerate(sampling):
            row.token_ids.append(placeholder(i))
            step.placeholders.append((row.token_ids, len(row.token_ids) - 1))
        self._unread = step
        return step

    def _read_back(self, step: StepInFlight) -> ModelRunnerOutput:
        tokens = np.asarray(step.out.token_ids)
        sampled = {rid: int(tokens[i]) for i, rid in enumerate(step.sampling_req_ids)}
        step.fill(sampled)
        logprobs = (
            self._logprobs(step.out, step.sampling) if step.num_logprobs is not None else None
        )
        prompt_lp = None
        if step.prompt_logprobs is not None:
            prompt_lp = immutables.Map(
                {
                    rid: _prompt_entry(width, arrays)
                    for rid, (width, arrays) in step.prompt_logprobs.items()
                }
            )
        order = step.order
        return ModelRunnerOutput(
            req_ids=order,
            sampled_token_ids=tuple((sampled[r],) if r in sampled else () for r in order),
            logprobs=None if logprobs is None else tuple(logprobs.get(r) for r in order),
            prompt_logprobs=prompt_lp,
        )

    def _multimodal(self, scheduler_output: SchedulerOutput, host_batch: HostBatch) -> dict:
        """A vision-language model's batch fields: this step's encoder outputs run and spliced
        at their placeholder rows (mm_embeds / mm_mask), and each sequence's bidirectional
        prefix (its prompt: image tokens + text) in prefix_lens. Always given for such a model,
        so a step with no image rows compiles the same program."""
        path = self.encoder_path
        if path is None:
            return {}
        order = host_batch.req_ids
        items_of = {r: self.rows[r].mm_inputs for r in order}
        path.encode(scheduler_output.scheduled_encoder_inputs, items_of)
        num_rows = host_batch.arrays["token_ids"].shape[0]
        computed = {r: self.rows[r].num_computed_tokens for r in order}
        embeds, mask = path.rows(
            order, items_of, computed, scheduler_output.num_scheduled_tokens, num_rows
        )
        prefix_lens = np.zeros(host_batch.arrays["kv_lens"].shape[0], np.int32)
        prefix_lens[: len(order)] = [self.rows[r].prompt_len for r in order]
        return dict(mm_embeds=embeds, mm_mask=mask, prefix_lens=prefix_lens)

    def _on_mesh(self):
        """The context a step's jitted calls trace under: the engine's mesh, if it has one."""
        if self.placement is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.placement.mesh)

    @staticmethod
    def _sampling_row(row: RequestRow) -> SamplingRow:
        # The row's own token list, not a copy: only penalties and bad words read it.
        return SamplingRow(
            row.req_id, row.sampling_params, row.token_ids, row.prompt_len, row.eos_token_ids
        )

    @staticmethod
    def _logprobs(out, sampling: list[RequestRow]) -> dict[str, LogprobsEntry]:
        ids, vals, ranks = map(np.asarray, (out.logprob_token_ids, out.logprobs, out.ranks))
        entries = {}
        for i, row in enumerate(sampling):
            n = row.sampling_params.num_logprobs
            if n is None:
                continue
            entries[row.req_id] = LogprobsEntry(
                token_ids=(tuple(int(t) for t in ids[i, : n + 1]),),
                logprobs=(tuple(float(v) for v in vals[i, : n + 1]),),
                sampled_token_ranks=(int(ranks[i]),),
            )
        return entries

    def _prompt_logprobs(self, host_batch: HostBatch, hidden) -> dict:
        """Dispatch the prompt logprobs of this step's prompt rows: request id -> (width, the
        device arrays), read back with the step (`_prompt_entry`)."""
        result = {}
        for rid, (start, n) in host_batch.prompt_logprob_rows.items():
            row = self.rows[rid]
            chunk = row.num_computed_tokens  # prompt position of the chunk's first token
            done = row.num_prompt_logprobs_done  # <= chunk: checked before the step
            # The logprob at position p is for token p + 1; the last prompt position predicts the
            # first output token, which is not a prompt logprob. Positions before `done` were
            # returned before a preemption.
            end = min(chunk + n, row.prompt_len - 1)
            if end <= done:
                continue
            row.num_prompt_logprobs_done = end
            first, n, start = done, end - done, start + done - chunk
            k = logprobs_bucket(row.sampling_params.prompt_logprobs, self.model_config.vocab_size)
            next_ids = jnp.asarray(row.token_ids[first + 1 : first + 1 + n], jnp.int32)
            arrays = _prompt_logprobs(
                self.graphdef, self.params, hidden[start : start + n], next_ids, num_logprobs=k
            )
            result[rid] = (row.sampling_params.prompt_logprobs + 1, arrays)
        return result


def _needs_values(params) -> bool:
    """Whether sampling with `params` reads the values of the tokens so far (penalties, bad
    words), not only how many there are."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.bad_words_token_ids
    )


def _prompt_entry(width: int, arrays) -> LogprobsEntry:
    ids, vals, ranks = map(np.asarray, arrays)
    return LogprobsEntry(
        token_ids=tuple(tuple(int(t) for t in r[:width]) for r in ids),
        logprobs=tuple(tuple(float(v) for v in r[:width]) for r in vals),
        sampled_token_ranks=tuple(int(r) for r in ranks),
    )
