"""The pooling runner: one forward over the scheduled tokens, then pool, per request.

A pooling request is prefill-only (runtime/core): the step that computes its last prompt token
pools it, and the core finishes it in that step's update. The device step is a pure jitted
function `(graphdef, params, caches, batch) -> (caches, pooled [S, H], logits [S, L] | None,
hidden [T, H] | None)`: the family's forward, then `model.layers.pooler.pool` over each sequence's
tokens of this step (the model's pooling type), then the classification head where the model has
one. What differs per request (matryoshka `dimensions`, `normalize`, `use_activation`) is applied
on the host to the few rows that finish, in float32, as vLLM's pooler heads do: dimensions first,
then normalization.

Only whole prompts are pooled by MEAN and CLS (the engine turns chunked prefill off for them, as
vLLM does); LAST pools the last token of the chunk that ends the prompt, so a causal embedder may
chunk. Token tasks (`encode`) keep every computed row: a chunked prompt's rows are gathered
across its steps and restarted when the request computes from token 0 again (after a
preemption), so a pooled output always covers the whole prompt exactly once.
"""

from __future__ import annotations

import logging
from functools import partial

import jax
import numpy as np
from flax import nnx

from model.base import forward
from model.batch import ModelBatch
from model.layers.pooler import NORMALIZE_EPS, ONE_ROW, pool, pool_rows, pooled_rows
from runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from runtime.core.pooling_params import TOKEN_TASKS, PoolingParams
from runtime.runner.in_flight import StepInFlight
from runtime.runner.inputs import half_step_buckets
from runtime.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


@partial(jax.jit, static_argnames=("pooling_type", "classify", "want_hidden"), donate_argnums=(2,))
def _pool_step(graphdef, params, caches, batch, *, pooling_type, classify, want_hidden):
    if pooling_type in ONE_ROW and not want_hidden:
        # One token's state a sequence: a family that takes rows runs its last MLP on those alone.
        index, present = pooled_rows(
            batch.cu_q_lens, batch.num_seqs, batch.token_ids.shape[0], pooling_type
        )
        caches, chosen = forward(graphdef, params, caches, batch, index)
        pooled, hidden = pool_rows(chosen, present), None
    else:
        caches, hidden = forward(graphdef, params, caches, batch)
        pooled = pool(hidden, batch.cu_q_lens, batch.num_seqs, pooling_type)
    model = nnx.merge(graphdef, params)
    logits = model.classify(pooled) if classify else None
    rows = None
    if want_hidden:
        # A late-interaction retriever (ColPali) projects each token's state to its embedding.
        rows = model.embed_tokens(hidden) if hasattr(model, "embed_tokens") else hidden
    return caches, pooled, logits, rows


class PoolingRunner(ModelRunner):
    """ModelRunner for runner_type "pooling": the same weights, caches, batch layout and undo
    rules; `_execute` pools instead of sampling."""

    def __init__(self, model_config, **kwargs) -> None:
        super().__init__(model_config, **kwargs)
        self.pooling_type = model_config.pooling_type
        self.classifies = model_config.num_labels is not None
        self.problem_type = model_config.hf_config.get("problem_type")
        # BERT-like families read token types (a cross-encoder pair's second text is type 1).
        self.reads_token_types = "type_vocab_size" in model_config.hf_config
        # Live pooling requests' parameters, and a token task's rows of its earlier chunks.
        self.pooling: dict[str, PoolingParams] = {}
        self.token_rows: dict[str, list[np.ndarray]] = {}
        if not self.cache_specs:
            # A cache-less family (BERT) pads each sequence's attention to the block table's
            # width: the builder's usual minimum of 256 tokens would make a step of short prompts
            # pay for 256 (MiniLM, 8-256-token prompts: attention about as costly as every matmul
            # at 256). Tables as narrow as one block instead, in half steps.
            widest = self.builder.max_blocks_per_seq
            self.builder.block_buckets = tuple(
                sorted({min(b, widest) for b in half_step_buckets(1, widest)})
            )

    def _launch(self, scheduler_output: SchedulerOutput, order: list[str]) -> StepInFlight:
        # Pooling runs synchronously (the engine refuses async scheduling for pooling models).
        output = self._execute(scheduler_output, order)
        return StepInFlight(scheduler_output.step, tuple(order), output=output)

    def _execute(self, scheduler_output: SchedulerOutput, order: list[str]) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_req_ids:
            self.pooling.pop(request_id, None)
            self.token_rows.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.pooling_params is None:
                raise ValueError(
                    f"request {new.req_id!r} reached the pooling runner without pooling_params "
                    "(a generate request on a pooling model)"
                )
            self.pooling[new.req_id] = new.pooling_params
        num_scheduled = scheduler_output.num_scheduled_tokens
        host_batch = self.builder.build(self.rows, num_scheduled, order)
        arrays = dict(host_batch.arrays)
        if self.reads_token_types:
            arrays["token_type_ids"] = self._token_types(order, num_scheduled, arrays)
        want_hidden = any(self.pooling[rid].task in TOKEN_TASKS for rid in order)
        self.kv_caches, pooled, logits, hidden = _pool_step(
            self.graphdef,
            self.params,
            self.kv_caches,
            ModelBatch(**arrays, **self._multimodal(scheduler_output, host_batch)),
            pooling_type=self.pooling_type,
            classify=self.classifies,
            want_hidden=want_hidden,
        )
        finishing = frozenset(host_batch.sampling_req_ids)  # their prompt ends this step
        index = {rid: i for i, rid in enumerate(order)}
        pooled = np.asarray(pooled, np.float32)
        logits = None if logits is None else np.asarray(logits, np.float32)
        hidden = None if hidden is None else np.asarray(hidden, np.float32)
        starts = arrays["cu_q_lens"]
        outputs = []
        for rid in order:
            params = self.pooling[rid]
            i = index[rid]
            if params.task in TOKEN_TASKS:
                rows = self._gather_rows(rid, hidden[starts[i] : starts[i + 1]])
                outputs.append(self._token_output(params, rows) if rid in finishing else None)
            elif rid in finishing:
                source = logits if params.task in ("classify", "score") else pooled
                outputs.append(self._sequence_output(params, source[i]))
            else:
                outputs.append(None)
        for rid in finishing:
            self.token_rows.pop(rid, None)
        return ModelRunnerOutput(
            req_ids=tuple(order),
            sampled_token_ids=((),) * len(order),
            pooler_output=tuple(outputs),
        )

    def _token_types(self, order, num_scheduled, arrays) -> np.ndarray:
        types = np.zeros_like(arrays["token_ids"])
        offset = 0
        for rid in order:
            n = num_scheduled[rid]
            start = self.pooling[rid].token_type_start
            if start is not None:
                first = self.rows[rid].num_computed_tokens
                positions = np.arange(first, first + n)
                types[offset : offset + n] = positions >= start
            offset += n
        return types

    def _gather_rows(self, rid: str, rows: np.ndarray) -> np.ndarray:
        """A token task's rows so far, this step's appended (restarted from token 0 when the
        request computes from the start again)."""
        computed = self.rows[rid].num_computed_tokens
        parts = [] if computed == 0 else self.token_rows.get(rid, [])
        have = sum(len(p) for p in parts)
        if have != computed:
            raise ValueError(
                f"request {rid!r} computes from token {computed} but the runner holds the rows "
                f"of {have} tokens: a token task must compute every prompt position"
            )
        parts = [*parts, rows]
        self.token_rows[rid] = parts
        return np.concatenate(parts) if len(parts) > 1 else rows

    def _sequence_output(self, params: PoolingParams, row: np.ndarray) -> np.ndarray:
        if params.task in ("classify", "score"):
            return self._activate(params, row)
        return _embedding(params, row)

    def _token_output(self, params: PoolingParams, rows: np.ndarray) -> np.ndarray:
        if params.task == "token_classify":
            raise ValueError("token_classify is not served (no token classification head)")
        return _embedding(params, rows)

    def _activate(self, params: PoolingParams, logits: np.ndarray) -> np.ndarray:
        """vLLM's classification activation (transformers' loss rules): none for regression or
        use_activation=False; sigmoid for a multi-label head or a single label; else softmax."""
        if not params.use_activation or self.problem_type == "regression":
            return logits
        if self.problem_type == "multi_label_classification" or logits.shape[-1] < 2:
            return 1.0 / (1.0 + np.exp(-logits))
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)


def _embedding(params: PoolingParams, rows: np.ndarray) -> np.ndarray:
    """Matryoshka truncation, then L2 normalization (torch's F.normalize floor), per row."""
    if params.dimensions is not None:
        rows = rows[..., : params.dimensions]
    if params.normalize:
        norm = np.sqrt(np.sum(rows * rows, axis=-1, keepdims=True))
        rows = rows / np.maximum(norm, NORMALIZE_EPS)
    return np.ascontiguousarray(rows, np.float32)
