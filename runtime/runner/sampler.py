"""Jitted batched sampling in vLLM V1 order, with per-row parameters from `SamplingMetadata`.

Order: raw logprobs (before any processing), f32, min-tokens mask, logit bias, penalties
(repetition, frequency, presence); greedy rows take the argmax; the others apply temperature,
min-p, top-k/top-p and sample by argmax(probs / q) with q ~ Exp(1) drawn from the row's own key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from runtime.runner.sampling_metadata import SamplingMetadata


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """token_ids[R]; with logprobs requested, column 0 of the [R, k+1] arrays is the sampled token
    and columns 1..k the top-k; `ranks` is the sampled token's 1-based rank (ties count as ahead)."""

    token_ids: jax.Array
    logprob_token_ids: jax.Array | None = None
    logprobs: jax.Array | None = None
    ranks: jax.Array | None = None


def gather_logprobs(
    logprobs: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids [N, k+1], values [N, k+1], ranks [N]) for the given tokens plus each row's top-k."""
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    ranks = jnp.sum(logprobs >= chosen, axis=-1).astype(jnp.int32)
    top_values, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    ids = jnp.concatenate([token_ids[:, None].astype(jnp.int32), top_ids.astype(jnp.int32)], -1)
    return ids, jnp.concatenate([chosen, top_values], axis=-1), ranks


@partial(jax.jit, static_argnames=("num_logprobs",))
def compute_prompt_logprobs(
    logits: jax.Array, next_token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw prompt logprobs: logits[T, V] at prompt positions, next_token_ids[T] the token that
    follows each position. Returns (ids [T, k+1], values [T, k+1], ranks [T])."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return gather_logprobs(logprobs, next_token_ids, num_logprobs)


def _row_keys(md: SamplingMetadata) -> jax.Array:
    def one(lo, hi, salt, counter):
        key = jax.random.fold_in(jax.random.key(lo), hi)
        return jax.random.fold_in(jax.random.fold_in(key, salt), counter)

    return jax.vmap(one)(md.seed_lo, md.seed_hi, md.salt, md.counter)


def _counts(ids: jax.Array, weights: jax.Array, vocab_size: int) -> jax.Array:
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab_size), jnp.float32).at[rows, ids].add(weights)


def _apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    out_counts = _counts(md.output_ids, md.output_valid, md.vocab_size)
    seen = (out_counts + _counts(md.prompt_ids, md.prompt_valid, md.vocab_size)) > 0
    rep = jnp.where(seen, md.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty[:, None] * out_counts
    return logits - md.presence_penalty[:, None] * (out_counts > 0)


def _apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    # One descending sort gives both cut-offs as a per-row logit threshold; ties at the threshold
    # are kept, as in vLLM.
    sorted_logits = -jnp.sort(-logits, axis=-1)
    vocab = logits.shape[-1]
    kth = jnp.take_along_axis(sorted_logits, (top_k - 1)[:, None], axis=-1)
    sorted_logits = jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = jnp.sum(before < top_p[:, None], axis=-1)
    keep = jnp.clip(jnp.minimum(keep, top_k), 1, vocab)
    threshold = jnp.take_along_axis(sorted_logits, (keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _random_sample(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    logits = logits / md.temperature[:, None]
    if md.needs_min_p:
        probs = jax.nn.softmax(logits, axis=-1)
        cutoff = md.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        logits = jnp.where(probs < cutoff, -jnp.inf, logits)
    if md.needs_top_k_top_p:
        logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
    probs = jax.nn.softmax(logits, axis=-1)
    q = jax.vmap(lambda k: jax.random.exponential(k, (md.vocab_size,), jnp.float32))(_row_keys(md))
    return jnp.argmax(probs / jnp.maximum(q, jnp.finfo(jnp.float32).tiny), axis=-1)


def _processed(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    rows = jnp.arange(md.num_rows)[:, None]
    logits = logits.at[rows, md.stop_ids].min(jnp.where(md.stop_active, -jnp.inf, jnp.inf))
    logits = logits.at[rows, md.bias_ids].add(md.bias_values)
    return _apply_penalties(logits, md) if md.needs_penalties else logits


def _check_shape(logits: jax.Array, md: SamplingMetadata) -> None:
    if logits.shape != (md.num_rows, md.vocab_size):
        raise ValueError(
            f"logits shape {logits.shape} does not match the metadata's "
            f"(rows, vocab) = {(md.num_rows, md.vocab_size)}"
        )


@jax.jit
def process_logits(logits: jax.Array, metadata: SamplingMetadata) -> jax.Array:
    """f32 logits after the min-tokens mask, logit bias and penalties (what greedy rows argmax;
    vLLM's "processed_logits" before temperature)."""
    _check_shape(logits, metadata)
    return _processed(logits.astype(jnp.float32), metadata)


@partial(jax.jit, static_argnames=("num_logprobs",))
def sample(
    logits: jax.Array, metadata: SamplingMetadata, num_logprobs: int | None = None
) -> SamplerOutput:
    """Sample one token per row of logits[R, V]; `num_logprobs` (static) adds raw logprobs."""
    md = metadata
    _check_shape(logits, md)
    logits = logits.astype(jnp.float32)
    raw_logprobs = None if num_logprobs is None else jax.nn.log_softmax(logits, axis=-1)
    logits = _processed(logits, md)
    token_ids = jnp.argmax(logits, axis=-1)
    if not md.all_greedy:
        token_ids = jnp.where(md.greedy, token_ids, _random_sample(logits, md))
    token_ids = token_ids.astype(jnp.int32)
    if raw_logprobs is None:
        return SamplerOutput(token_ids=token_ids)
    ids, values, ranks = gather_logprobs(raw_logprobs, token_ids, num_logprobs)
    return SamplerOutput(token_ids, ids, values, ranks)
