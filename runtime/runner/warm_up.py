"""Compiling a run's batch shapes up front, before its first step.

Every distinct (tokens, seqs, blocks/seq, decode chunks, tile pairs) bucket is one compilation of
the whole step (inputs.py); met one by one, each stalls the step that meets it. Compiled here
first, behind a progress bar, they cost the same time but the user sees what it is spent on, and
with JAX's persistent compilation cache (vlax/compilation_cache.py) a second run loads them from
disk.

Which shapes: a documented subset of what max_num_seqs / max_num_batched_tokens / max_model_len
allow (all of it is hundreds of shapes), the ones a batch of prompts meets for sure:
- the first step: FCFS admits prompts in order until the token budget or max_num_seqs is spent
  (the last one cut by chunked prefill), with nothing cached (BatchBuilder.tiled_steps: its
  live (query tile, KV chunk) pair bucket at the full table width);
- every decode step: one token per running request, for every count of running requests from
  all of them down to one, at every context bucket from the shortest prompt to the longest
  prompt plus its max_tokens - 1, the last token being sampled, never fed back (with the jnp
  decode path, BatchBuilder.decode_chunk_blocks: at every live-chunk bucket between the fewest
  and the most chunks that many requests can hold). A request asking for one token has none.
Mixed steps (a prompt admitted while others decode), prefix-cache hits and preemptions may meet
other shapes; those compile when met, as before. Prompt-logprob steps too (another program).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from model.batch import ModelBatch
from runtime.runner.inputs import BatchBuilder, bucket
from runtime.runner.sampling_metadata import SamplingRow, logprobs_bucket, make_sampling_metadata

log = logging.getLogger(__name__)

# (tokens, seqs, blocks per seq, live decode chunks or 0, live tile pairs or 0), as
# BatchBuilder.build pads them
Shape = tuple[int, int, int, int, int]


def run_shapes(
    builder: BatchBuilder,
    prompt_lens: Sequence[int],
    max_tokens: Sequence[int],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[Shape]:
    """The batch shapes a run of these requests (one entry per sequence) meets for sure: its
    first step and its decode steps (module docstring), in the order they are met."""
    if not prompt_lens:
        return []
    bs = builder.block_size

    def blocks(n: int) -> int:
        return bucket(min(-(-n // bs), builder.max_blocks_per_seq), builder.block_buckets)

    # The first step: prompts in order while the budget lasts.
    budget, takes = max_num_batched_tokens, []
    for n in prompt_lens[:max_num_seqs]:
        if budget == 0:
            break
        takes.append(min(n, budget))
        budget -= takes[-1]
    taken, seqs = sum(takes), len(takes)
    t_first, s_first = bucket(taken, builder.token_buckets), bucket(seqs, builder.seq_buckets)
    wide = builder.max_blocks_per_seq
    if builder.decode_chunk_blocks and taken == seqs:  # every first prompt is one token
        first = builder.decode_chunk_buckets(s_first)
        shapes = [(t_first, s_first, wide, bucket(seqs, first), 0)]
    elif builder.tiled_steps:
        pairs = builder.tile_bucket(((n, n) for n in takes), t_first, s_first)
        shapes = [(t_first, s_first, wide, 0, pairs)]
    else:
        shapes = [(t_first, s_first, blocks(max(takes)), 0, 0)]
    # Decode: the step that feeds a request's k-th output token back has context prompt + k, for
    # k from 1 to max_tokens - 1 (the last token is sampled, never fed back): a request asking for
    # one token decodes never (`vlax generate --max-tokens 1` compiles its first step only).
    decoding = [(p, m) for p, m in zip(prompt_lens, max_tokens, strict=True) if m >= 2]
    if not decoding:
        return shapes
    running = min(len(decoding), max_num_seqs)
    shortest = min(p for p, _ in decoding) + 1
    longest = max(p + m - 1 for p, m in decoding)
    counts: dict[tuple[int, int], list[int]] = {}
    for n in range(1, running + 1):
        key = (bucket(n, builder.token_buckets), bucket(n, builder.seq_buckets))
        counts.setdefault(key, []).append(n)
    for (t, s), ns in sorted(counts.items(), reverse=True):
        if builder.decode_chunk_blocks:
            chunk_buckets = builder.decode_chunk_buckets(s)
            lo = bucket(min(ns) * builder.chunks_of(shortest), chunk_buckets)
            hi = bucket(max(ns) * builder.chunks_of(longest), chunk_buckets)
            met = [(t, s, wide, c, 0) for c in chunk_buckets if lo <= c <= hi]
        else:
            lo, hi = blocks(shortest), blocks(longest)
            met = [(t, s, b, 0, 0) for b in builder.block_buckets if lo <= b <= hi]
        shapes.extend(shape for shape in met if shape not in shapes)
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
        logprobs_bucket(sampling_params.logprobs, runner.model_config.vocab_size),
        metadata.all_greedy,
        metadata.needs_penalties,
        metadata.needs_top_k_top_p,
        metadata.needs_min_p,
        metadata.needs_allowed,
    )


def precompile(
    runner,
    shapes: Sequence[Shape],
    sampling_params,
    *,
    done: Callable[[Shape], None] = lambda shape: None,
) -> bool:
    """Compile `runner`'s step for each shape, for requests sampling with `sampling_params`
    (its static sampler flags and logprobs width are part of the program). Nothing runs: the
    step is lowered and compiled, which fills the jitted step's own cache. Returns False, doing
    nothing, for a runner whose step takes more than a text batch (a vision-language model's
    encoder fields) or runs over several devices: their shapes compile when met."""
    from runtime.runner.model_runner import _step

    if runner.encoder_path is not None or runner.placement is not None:
        return False
    k = logprobs_bucket(sampling_params.logprobs, runner.model_config.vocab_size)
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
    return True
