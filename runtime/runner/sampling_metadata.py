"""Per-row sampling parameters as padded numpy arrays, built on the host for the jitted sampler.

The engine hands one `SamplingRow` per scheduled request (in batch order); `make_sampling_metadata`
turns them into a `SamplingMetadata` pytree whose array shapes depend only on bucketed sizes, so the
number of sampler compilations stays small.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from runtime.runner.errors import RequestFailed

GREEDY_TEMPERATURE = 1e-5
LOGPROBS_BUCKETS = (0, 5, 20)
_MIN_WIDTH = 8
MAX_VOCAB_SIZE = 1 << 24  # the sampler's argmax carries token indices exactly in f32


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one request this step.

    `params` is a `SamplingParams` (duck-typed on its vLLM field names). `token_ids` are the prompt
    followed by the tokens generated so far (the runner's own list, not copied: only penalties and
    bad words read it); the token being sampled now is output number `num_output_tokens`.
    `eos_token_ids` are the request's EOS ids, held back with its stop ids while it is below
    min_tokens.
    """

    request_id: str
    params: Any
    token_ids: Sequence[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


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
    # Ids set to -inf this step: stop and EOS ids while the row is below min_tokens, and the last
    # token of each bad word whose other tokens the output ends with.
    masked_ids: np.ndarray  # i32[R, M]
    masked: np.ndarray  # bool[R, M]
    # allowed_token_ids: a row with any valid entry samples only among its valid entries.
    allowed_ids: np.ndarray  # i32[R, A]
    allowed_valid: np.ndarray  # f32[R, A]
    bias_ids: np.ndarray  # i32[R, B]
    bias_values: np.ndarray  # f32[R, B], 0 on padding
    # logprob_token_ids: a row with any valid entry returns these ids' logprobs, in this order,
    # in place of its top-k.
    logprob_ids: np.ndarray  # i32[R, L]
    logprob_ids_valid: np.ndarray  # f32[R, L]
    vocab_size: int = field(metadata={"static": True})
    all_greedy: bool = field(metadata={"static": True})
    needs_penalties: bool = field(metadata={"static": True})
    needs_top_k_top_p: bool = field(metadata={"static": True})
    needs_min_p: bool = field(metadata={"static": True})
    needs_allowed: bool = field(metadata={"static": True})
    needs_listed_logprobs: bool = field(metadata={"static": True})

    @property
    def num_rows(self) -> int:
        return int(self.greedy.shape[0])


def logprobs_bucket(num_logprobs: int | None, vocab_size: int | None = None) -> int | None:
    """The static logprobs width to compile for a batch whose largest request asks `num_logprobs`:
    a bucket, but never wider than the vocabulary (top-k of more than V entries does not exist)."""
    if num_logprobs is None:
        return None
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0 or None, got {num_logprobs}")
    if vocab_size is not None and num_logprobs > vocab_size:
        raise ValueError(f"num_logprobs={num_logprobs} exceeds the vocabulary size {vocab_size}")
    width = next(
        (b for b in LOGPROBS_BUCKETS if num_logprobs <= b), 1 << (num_logprobs - 1).bit_length()
    )
    return width if vocab_size is None else min(width, vocab_size)


def _width(n: int) -> int:
    return max(_MIN_WIDTH, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def _request_salt(request_id: str) -> int:
    # crc32 is stable across processes (unlike hash()); +1 keeps unseeded salts apart from seeded 0.
    return zlib.crc32(request_id.encode()) % 0xFFFFFFFF + 1


def _bias_pairs(logit_bias: Any) -> tuple[tuple[int, float], ...]:
    if logit_bias is None:
        return ()
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    return tuple((int(t), float(b)) for t, b in items)


def _bad_word_bans(sequences: Sequence[tuple[int, ...]], row: SamplingRow) -> list[int]:
    """vLLM's bad-words rule on one row: a sequence's last token is banned when the row's output
    so far ends with the rest of the sequence (always, for a one-token sequence). Only output
    tokens count, never the prompt."""
    tokens = row.token_ids
    end = len(tokens)
    num_output = end - row.num_prompt_tokens
    bans = []
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (k <= num_output and tuple(tokens[end - k : end]) == seq[:k]):
            bans.append(seq[k])
    return bans


def _out_of_vocab(what: str, row: SamplingRow, token_id: int, vocab_size: int) -> RequestFailed:
    return RequestFailed(
        [row.request_id],
        f"request {row.request_id!r}: {what} contains token id {token_id}, "
        f"expected ids in [0, {vocab_size})",
    )


def _check_ids(
    what: str, rows: Sequence[SamplingRow], ids: np.ndarray, valid: np.ndarray, vocab_size: int
) -> None:
    """RequestFailed (a ValueError) naming the first row whose valid `ids` leave
    [0, vocab_size). The input processor checks every id at admission; this guards callers that
    bypass it, and names the request so the engine can fail it alone."""
    bad = (valid > 0) & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise _out_of_vocab(what, rows[r], int(ids[r, c]), vocab_size)


def _check_lists(
    what: str, rows: Sequence[SamplingRow], lists: Sequence[Sequence[int]], vocab_size: int
) -> None:
    """_check_ids on per-row id lists before padding (min / max run at C speed)."""
    for row, ids in zip(rows, lists, strict=True):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise _out_of_vocab(
                what, row, next(t for t in ids if not 0 <= t < vocab_size), vocab_size
            )


def _pad_rows(lists: list[Sequence[int]], num_rows: int, width: int) -> tuple[np.ndarray, ...]:
    ids = np.zeros((num_rows, width), np.int32)
    valid = np.zeros((num_rows, width), np.float32)
    for r, seq in enumerate(lists):
        if seq:
            ids[r, : len(seq)] = seq
            valid[r, : len(seq)] = 1.0
    return ids, valid


def _static_values(params: Any, vocab_size: int, global_seed: int) -> tuple:
    """One request's per-step-constant sampler values, in _STATIC order (all exact in float64).
    Greedy rows keep neutral values: temperature 1 (nothing divides by ~0), no top-k/p, min-p."""
    p = params
    greedy = p.temperature < GREEDY_TEMPERATURE
    seed = int(global_seed if p.seed is None else p.seed) % (1 << 64)
    return (
        greedy,
        1.0 if greedy else p.temperature,
        vocab_size if greedy or p.top_k in (0, -1) else min(p.top_k, vocab_size),
        1.0 if greedy else p.top_p,
        0.0 if greedy else p.min_p,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
        seed & 0xFFFFFFFF,
        seed >> 32,
    )


# Column order of _static_values, and each column's value on padding rows.
_STATIC = (
    ("greedy", bool, True),
    ("temperature", np.float32, 1.0),
    ("top_k", np.int32, None),  # vocab_size
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("presence_penalty", np.float32, 0.0),
    ("frequency_penalty", np.float32, 0.0),
    ("repetition_penalty", np.float32, 1.0),
    ("seed_lo", np.uint32, 0),
    ("seed_hi", np.uint32, 0),
)


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
    This runs every step for every row: the per-request constants are computed once per distinct
    SamplingParams (a batch usually shares one) and converted to arrays in one call.
    """
    if num_rows < len(rows):
        raise ValueError(f"num_rows={num_rows} is smaller than the {len(rows)} rows given")
    if not 0 < vocab_size < MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: expected 0 < vocab_size < {MAX_VOCAB_SIZE}")
    params = [row.params for row in rows]
    by_params: dict[int, tuple] = {}
    distinct = []
    values = []
    for p in params:
        v = by_params.get(id(p))
        if v is None:
            v = by_params[id(p)] = _static_values(p, vocab_size, global_seed)
            distinct.append(p)
        values.append(v)
    table = np.array(values, np.float64).reshape(len(rows), len(_STATIC))
    columns = {}
    for i, (name, dtype, pad) in enumerate(_STATIC):
        column = np.full(num_rows, vocab_size if pad is None else pad, dtype)
        column[: len(rows)] = table[:, i]
        columns[name] = column
    greedy, top_k, top_p, min_p = (columns[k] for k in ("greedy", "top_k", "top_p", "min_p"))
    presence, frequency, repetition = (
        columns[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    )
    # Only unseeded sampling rows read their salt; the counter is the output position of seeded
    # rows and the engine step for the others.
    step_counter = step % (1 << 32)
    salt = np.zeros(num_rows, np.uint32)
    salt[: len(rows)] = [
        0 if p.seed is not None or v[0] else _request_salt(row.request_id)
        for p, v, row in zip(params, values, rows, strict=True)
    ]
    counter = np.zeros(num_rows, np.uint32)
    counter[: len(rows)] = [
        step_counter if p.seed is None else row.num_output_tokens
        for p, row in zip(params, rows, strict=True)
    ]
    # While a row is below min_tokens its stop ids and (unless ignore_eos) every EOS id are held back.
    stops = [
        (p.stop_token_ids + (() if p.ignore_eos else row.eos_token_ids))
        if p.min_tokens and row.num_output_tokens < p.min_tokens
        else ()
        for p, row in zip(params, rows, strict=True)
    ]
    biases = [_bias_pairs(p.logit_bias) for p in params]
    # Most batches use neither bad words nor allowed ids: their per-row passes are skipped.
    if any(p.bad_words_token_ids for p in distinct):
        bans = [
            _bad_word_bans(p.bad_words_token_ids, row) if p.bad_words_token_ids else ()
            for p, row in zip(params, rows, strict=True)
        ]
        # Both are -inf masks, so one array carries them (vLLM applies bad words, then
        # min_tokens): no new array, no new compilation.
        masked = [(*s, *b) for s, b in zip(stops, bans, strict=True)]
    else:
        bans, masked = [], stops
    if any(p.allowed_token_ids for p in distinct):
        allowed = [p.allowed_token_ids or () for p in params]
    else:
        allowed = []
    listed = (
        [p.logprob_token_ids or () for p in params]
        if any(p.logprob_token_ids for p in distinct)
        else []
    )

    needs_penalties = bool(
        np.any(presence != 0) or np.any(frequency != 0) or np.any(repetition != 1)
    )
    if needs_penalties:
        prompts = [row.prompt_token_ids for row in rows]
        outputs = [row.output_token_ids for row in rows]
    else:
        prompts, outputs = [], []
    prompt_ids, prompt_valid = _pad_rows(
        prompts, num_rows, _width(max(map(len, prompts), default=0))
    )
    output_ids, output_valid = _pad_rows(
        outputs, num_rows, _width(max(map(len, outputs), default=0))
    )
    for what, lists in (
        ("stop_token_ids", stops),
        ("bad_words_token_ids", bans),
        ("allowed_token_ids", allowed),
        ("logprob_token_ids", listed),
    ):
        if any(lists):
            _check_lists(what, rows, lists, vocab_size)
    masked_ids, masked_valid = _pad_rows(masked, num_rows, _width(max(map(len, masked), default=0)))
    allowed_ids, allowed_valid = _pad_rows(
        allowed, num_rows, _width(max(map(len, allowed), default=0))
    )
    logprob_ids, logprob_ids_valid = _pad_rows(
        listed, num_rows, _width(max(map(len, listed), default=0))
    )
    bias_ids, bias_valid = _pad_rows(
        [[t for t, _ in b] for b in biases], num_rows, _width(max(map(len, biases), default=0))
    )
    for what, lists, ids, valid in (
        ("logit_bias", biases, bias_ids, bias_valid),
        ("prompt_token_ids", prompts, prompt_ids, prompt_valid),
        ("output_token_ids", outputs, output_ids, output_valid),
    ):
        if any(lists):
            _check_ids(what, rows, ids, valid, vocab_size)
    bias_values = np.zeros(bias_ids.shape, np.float32)
    for r, b in enumerate(biases):
        if b:
            bias_values[r, : len(b)] = [v for _, v in b]
    sampling = ~greedy[: len(rows)]
    return SamplingMetadata(
        **columns,
        salt=salt,
        counter=counter,
        prompt_ids=prompt_ids,
        prompt_valid=prompt_valid,
        output_ids=output_ids,
        output_valid=output_valid,
        masked_ids=masked_ids,
        masked=masked_valid > 0,
        allowed_ids=allowed_ids,
        allowed_valid=allowed_valid,
        bias_ids=bias_ids,
        bias_values=bias_values,
        logprob_ids=logprob_ids,
        logprob_ids_valid=logprob_ids_valid,
        vocab_size=vocab_size,
        all_greedy=not sampling.any(),
        needs_penalties=needs_penalties,
        needs_top_k_top_p=bool(np.any((top_k < vocab_size) | (top_p < 1.0))),
        needs_min_p=bool(np.any(min_p > 0)),
        needs_allowed=any(allowed),
        needs_listed_logprobs=any(listed),
    )
