"""Per-row sampling parameters as padded numpy arrays, built on the host for the jitted sampler.

The engine hands one `SamplingRow` per scheduled request (in batch order); `make_sampling_metadata`
turns them into a `SamplingMetadata` pytree whose array shapes depend only on bucketed sizes, so the
number of sampler compilations stays small.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

GREEDY_TEMPERATURE = 1e-5
LOGPROBS_BUCKETS = (0, 5, 20)
_MIN_WIDTH = 8
MAX_VOCAB_SIZE = 1 << 24  # the sampler's argmax carries token indices exactly in f32


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one request this step.

    `params` is a `SamplingParams` (duck-typed on its vLLM field names). `output_token_ids` are the
    tokens generated so far; the token being sampled now is output number `len(output_token_ids)`.
    """

    request_id: str
    params: Any
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_id: int | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Per-row sampling arrays; R rows (bucketed), V vocabulary entries.

    Padded id arrays pair with 0/1 validity weights (pad id 0, weight 0) so scatters need no
    out-of-range ids. Static flags let the jitted sampler skip whole stages no row needs.
    """

    greedy: np.ndarray  # bool[R]
    temperature: np.ndarray  # f32[R], 1.0 on greedy rows so nothing divides by ~0
    top_k: np.ndarray  # i32[R], V when off
    top_p: np.ndarray  # f32[R]
    min_p: np.ndarray  # f32[R]
    presence_penalty: np.ndarray  # f32[R]
    frequency_penalty: np.ndarray  # f32[R]
    repetition_penalty: np.ndarray  # f32[R]
    seed_lo: np.ndarray  # u32[R]: low / high halves of the 64-bit stream seed
    seed_hi: np.ndarray  # u32[R]
    salt: np.ndarray  # u32[R]: 0 for seeded rows, request-id derived (never 0) otherwise
    counter: np.ndarray  # u32[R]: output position (seeded) or engine step (unseeded)
    prompt_ids: np.ndarray  # i32[R, P]
    prompt_valid: np.ndarray  # f32[R, P]
    output_ids: np.ndarray  # i32[R, O]
    output_valid: np.ndarray  # f32[R, O]
    stop_ids: np.ndarray  # i32[R, S]: ids masked while the row is below min_tokens
    stop_active: np.ndarray  # bool[R, S]
    bias_ids: np.ndarray  # i32[R, B]
    bias_values: np.ndarray  # f32[R, B], 0 on padding
    vocab_size: int = field(metadata={"static": True})
    all_greedy: bool = field(metadata={"static": True})
    needs_penalties: bool = field(metadata={"static": True})
    needs_top_k_top_p: bool = field(metadata={"static": True})
    needs_min_p: bool = field(metadata={"static": True})

    @property
    def num_rows(self) -> int:
        return int(self.greedy.shape[0])


def logprobs_bucket(num_logprobs: int | None) -> int | None:
    """The static logprobs width to compile for a batch whose largest request asks `num_logprobs`."""
    if num_logprobs is None:
        return None
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0 or None, got {num_logprobs}")
    for bucket in LOGPROBS_BUCKETS:
        if num_logprobs <= bucket:
            return bucket
    return 1 << (num_logprobs - 1).bit_length()


def _width(n: int) -> int:
    return max(_MIN_WIDTH, 1 << max(0, n - 1).bit_length())


def _request_salt(request_id: str) -> int:
    # crc32 is stable across processes (unlike hash()); +1 keeps unseeded salts apart from seeded 0.
    return zlib.crc32(request_id.encode()) % 0xFFFFFFFF + 1


def _bias_pairs(logit_bias: Any) -> tuple[tuple[int, float], ...]:
    if logit_bias is None:
        return ()
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    return tuple((int(t), float(b)) for t, b in items)


def _check_ids(what: str, request_id: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"request {request_id!r}: {what} contains token id {bad[0]}, "
            f"expected ids in [0, {vocab_size})"
        )


def _pad_rows(lists: list[Sequence[int]], num_rows: int, width: int) -> tuple[np.ndarray, ...]:
    ids = np.zeros((num_rows, width), np.int32)
    valid = np.zeros((num_rows, width), np.float32)
    for r, seq in enumerate(lists):
        ids[r, : len(seq)] = seq
        valid[r, : len(seq)] = 1.0
    return ids, valid


def make_sampling_metadata(
    rows: Sequence[SamplingRow],
    *,
    num_rows: int,
    vocab_size: int,
    global_seed: int,
    step: int,
) -> SamplingMetadata:
    """Build the sampler's arrays for `rows`, padded to `num_rows` (pad rows sample harmlessly).

    Seeded rows draw from a stream keyed by (seed, output position) alone, so their tokens do not
    depend on the batch they share. Unseeded rows use (global_seed, request id, step).
    """
    if num_rows < len(rows):
        raise ValueError(f"num_rows={num_rows} is smaller than the {len(rows)} rows given")
    if not 0 < vocab_size < MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: expected 0 < vocab_size < {MAX_VOCAB_SIZE}")
    f32, u32 = np.float32, np.uint32
    greedy = np.ones(num_rows, bool)
    temperature = np.ones(num_rows, f32)
    top_k = np.full(num_rows, vocab_size, np.int32)
    top_p = np.ones(num_rows, f32)
    min_p = np.zeros(num_rows, f32)
    presence = np.zeros(num_rows, f32)
    frequency = np.zeros(num_rows, f32)
    repetition = np.ones(num_rows, f32)
    seed_lo = np.zeros(num_rows, u32)
    seed_hi = np.zeros(num_rows, u32)
    salt = np.zeros(num_rows, u32)
    counter = np.zeros(num_rows, u32)
    stops: list[Sequence[int]] = []
    biases: list[tuple[tuple[int, float], ...]] = []
    for r, row in enumerate(rows):
        p = row.params
        greedy[r] = p.temperature < GREEDY_TEMPERATURE
        if not greedy[r]:
            temperature[r] = p.temperature
            top_k[r] = vocab_size if p.top_k in (0, -1) else min(p.top_k, vocab_size)
            top_p[r] = p.top_p
            min_p[r] = p.min_p
        presence[r] = p.presence_penalty
        frequency[r] = p.frequency_penalty
        repetition[r] = p.repetition_penalty
        if p.seed is not None:
            seed = int(p.seed) % (1 << 64)
            seed_lo[r], seed_hi[r] = seed & 0xFFFFFFFF, seed >> 32
            counter[r] = len(row.output_token_ids)
        else:
            seed = int(global_seed) % (1 << 64)
            seed_lo[r], seed_hi[r] = seed & 0xFFFFFFFF, seed >> 32
            salt[r] = _request_salt(row.request_id)
            counter[r] = step % (1 << 32)
        stop = tuple(p.stop_token_ids)
        if row.eos_token_id is not None and not p.ignore_eos:
            stop += (row.eos_token_id,)
        stop = stop if len(row.output_token_ids) < p.min_tokens else ()
        _check_ids("stop_token_ids", row.request_id, stop, vocab_size)
        stops.append(stop)
        bias = _bias_pairs(p.logit_bias)
        _check_ids("logit_bias", row.request_id, [t for t, _ in bias], vocab_size)
        biases.append(bias)

    needs_penalties = bool(
        np.any(presence != 0) or np.any(frequency != 0) or np.any(repetition != 1)
    )
    if needs_penalties:
        prompts = [tuple(row.prompt_token_ids) for row in rows]
        outputs = [tuple(row.output_token_ids) for row in rows]
        for row, prompt, output in zip(rows, prompts, outputs, strict=True):
            _check_ids("prompt_token_ids", row.request_id, prompt, vocab_size)
            _check_ids("output_token_ids", row.request_id, output, vocab_size)
    else:
        prompts, outputs = [], []
    prompt_ids, prompt_valid = _pad_rows(
        prompts, num_rows, _width(max(map(len, prompts), default=0))
    )
    output_ids, output_valid = _pad_rows(
        outputs, num_rows, _width(max(map(len, outputs), default=0))
    )
    stop_ids, stop_valid = _pad_rows(stops, num_rows, _width(max(map(len, stops), default=0)))
    bias_ids, _ = _pad_rows(
        [[t for t, _ in b] for b in biases], num_rows, _width(max(map(len, biases), default=0))
    )
    bias_values = np.zeros(bias_ids.shape, f32)
    for r, b in enumerate(biases):
        bias_values[r, : len(b)] = [v for _, v in b]
    sampling = ~greedy[: len(rows)]
    return SamplingMetadata(
        greedy=greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        seed_lo=seed_lo,
        seed_hi=seed_hi,
        salt=salt,
        counter=counter,
        prompt_ids=prompt_ids,
        prompt_valid=prompt_valid,
        output_ids=output_ids,
        output_valid=output_valid,
        stop_ids=stop_ids,
        stop_active=stop_valid > 0,
        bias_ids=bias_ids,
        bias_values=bias_values,
        vocab_size=vocab_size,
        all_greedy=not sampling.any(),
        needs_penalties=needs_penalties,
        needs_top_k_top_p=bool(np.any((top_k < vocab_size) | (top_p < 1.0))),
        needs_min_p=bool(np.any(min_p > 0)),
    )
