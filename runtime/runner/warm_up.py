"""Compiling a run's batch shapes up front, before its first step.

Every distinct (tokens, seqs, blocks/seq, decode chunks, tile pairs) bucket is one compilation of
the whole step (inputs.py); met one by one, each stalls the step that meets it. Compiled here
first, behind a progress bar, they cost the same time but the user sees what it is spent on, and
with JAX's persistent compilation cache (vlax/compilation_cache.py) a second run loads them from
disk.

Which shapes: those of a dry run of the pure core (planned_shapes), from the engine's state with
the new requests added, each request running to its max_tokens: the steps a run meets when no
request stops early on EOS, a stop id or a stop string, and nothing outside the core changes the
plan. An early stop, async scheduling (a finishing request is planned once more), a KV-store load
or another sampler key (another program: the sampler's static flags and logprobs width, taken from
the first request) may meet other shapes; those compile when met. Prompt-logprob steps too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from model.batch import ModelBatch
from runtime.core import scheduler as sched
from runtime.core.outputs import ModelRunnerOutput
from runtime.runner.inputs import BatchBuilder, Shape
from runtime.runner.sampling_metadata import SamplingRow, logprobs_bucket, make_sampling_metadata

log = logging.getLogger(__name__)

# The dry run's bound: a core step costs ~0.1-1 ms of host time, so a run this long plans in
# seconds; steps past it compile when met.
PLANNED_STEPS = 4096


def planned_shapes(state, builder: BatchBuilder, *, max_steps: int = PLANNED_STEPS) -> list[Shape]:
    """The shapes of the steps the core schedules for the requests `state` holds, in the order
    they are met (each once), when every request runs to its max_tokens or max_model_len: a dry
    run of the pure core from `state`, a value, so the engine's own state is untouched. Each
    step's output is applied as if every row that samples drew a token no request stops on.
    Chunked prefill, preemption and prefix-cache hits (on what the state caches, and among the
    requests themselves) come out as the real run meets them. At most `max_steps` steps."""
    stop_ids = {0}
    for request in state.requests.values():
        stop_ids.update(request.eos_token_ids, request.sampling_params.stop_token_ids)
    token = max(stop_ids) + 1  # a token none of them stops on
    shapes: list[Shape] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests(state):
            break
        scheduled, out = sched.schedule(state)
        if out.total_num_scheduled_tokens == 0:
            break  # waiting on something outside the core (a KV load): the rest compiles when met
        rows = (*out.scheduled_new_reqs, *out.scheduled_cached_reqs)
        q_lens = [out.num_scheduled_tokens[row.req_id] for row in rows]
        kv_lens = [row.num_computed_tokens + n for row, n in zip(rows, q_lens, strict=True)]
        shape = builder.shape(q_lens, kv_lens)
        if shape not in shapes:
            shapes.append(shape)
        # A row samples when its scheduled tokens reach past every token it has.
        sampled = tuple(
            (token,) if end >= state.requests[row.req_id].num_tokens else ()
            for row, end in zip(rows, kv_lens, strict=True)
        )
        output = ModelRunnerOutput(tuple(row.req_id for row in rows), sampled)
        state, _ = sched.update(scheduled, out, output)
    return shapes


def padding_batch(builder: BatchBuilder, shape: Shape) -> dict[str, np.ndarray]:
    """A batch of `shape` whose every row is padding: the arrays BatchBuilder.build makes for
    a step of that shape, same names, dtypes and shapes (only the shapes matter to compile;
    the shape's decode chunks and tile pairs go to ModelBatch beside them)."""
    t, s, mb, _, _ = shape
    return dict(
        token_ids=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        slot_mapping=np.full(t, -1, np.int32),
        block_tables=np.zeros((s, mb), np.int32),
        kv_lens=np.zeros(s, np.int32),
        cu_q_lens=np.zeros(s + 1, np.int32),
        num_seqs=np.asarray(0, np.int32),
        logits_indices=np.zeros(s, np.int32),
        state_slots=np.full(s, builder.num_state_slots, np.int32),
        state_reset=np.ones(s, np.bool_),
    )


def _metadata(runner, sampling_params, num_rows: int):
    row = SamplingRow("warm-up", sampling_params, [0], 1)
    return make_sampling_metadata(
        [row],
        num_rows=num_rows,
        vocab_size=runner.model_config.vocab_size,
        global_seed=runner.seed,
        step=0,
    )


def sampler_key(runner, sampling_params) -> tuple:
    """What of `sampling_params` is compiled into the step: the sampler's static flags and the
    logprobs width. Two params with the same key share the step's programs."""
    metadata = _metadata(runner, sampling_params, 1)
    return (
        logprobs_bucket(sampling_params.num_logprobs, runner.model_config.vocab_size),
        metadata.all_greedy,
        metadata.needs_penalties,
        metadata.needs_top_k_top_p,
        metadata.needs_min_p,
        metadata.needs_allowed,
        metadata.needs_listed_logprobs,
    )


def compiles_up_front(runner) -> bool:
    """Whether precompile serves `runner`: not for a step that takes more than a text batch (a
    vision-language model's encoder fields) or runs over several devices."""
    return runner.encoder_path is None and runner.placement is None


def precompile(
    runner,
    shapes: Sequence[Shape],
    sampling_params,
    *,
    done: Callable[[Shape], None] = lambda shape: None,
) -> None:
    """Compile `runner`'s step for each shape, for requests sampling with `sampling_params`
    (its static sampler flags and logprobs width are part of the program). Nothing runs: the
    step is lowered and compiled, which fills the jitted step's own cache. For a runner
    `compiles_up_front` accepts (the caller asks first, before it plans any shape)."""
    from runtime.runner.model_runner import _step

    k = logprobs_bucket(sampling_params.num_logprobs, runner.model_config.vocab_size)
    for shape in shapes:
        batch = ModelBatch(
            **padding_batch(runner.builder, shape), decode_chunks=shape[3], tile_chunks=shape[4]
        )
        metadata = _metadata(runner, sampling_params, shape[1])
        _step.lower(
            runner.graphdef,
            runner.params,
            runner.kv_caches,
            batch,
            metadata,
            np.zeros(runner.builder.seq_buckets[-1], np.int32),
            num_logprobs=k,
            want_hidden=False,
        ).compile()
        log.info("compiled batch shape: tokens=%d seqs=%d blocks/seq=%d chunks=%d pairs=%d", *shape)
        done(shape)
