"""Request value types: SamplingParams, multimodal inputs, request status and the Request itself.

All are frozen values. User-facing constructors validate their fields and normalise lists to
tuples; the scheduler derives new requests from valid ones with `evolve`, which skips validation
because it runs for every request every step.
"""

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from runtime.core.kv.block_pool import BlockHash
from runtime.core.pooling_params import PoolingParams

__all__ = [
    "FinishReason",
    "MultiModalInput",
    "PoolingParams",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "evolve",
]

_GREEDY_EPS = 1e-5
# vLLM 0.33's bounds: a temperature past 2 is refused, and one in (0, 0.01) is raised to 0.01
# (below it the scaled logits may overflow to inf / NaN), so only 0 itself samples greedily.
MAX_TEMPERATURE = 2.0
MIN_SAMPLING_TEMPERATURE = 0.01
# vLLM's bound on logprob_token_ids (MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bad(owner: str, name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{owner}.{name}={value!r}: expected {expected}")


def _int_tuple(owner: str, name: str, value: object, *, minimum: int = 0) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise _bad(owner, name, value, f"a sequence of ints >= {minimum}")
    items = tuple(value)
    for item in items:
        if not _is_int(item) or item < minimum:
            raise _bad(owner, name, value, f"a sequence of ints >= {minimum} (bad item {item!r})")
    return items


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """vLLM's sampling parameters (same names, defaults and ranges)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # With skip_special_tokens=False, whether the text puts the decoder's spaces between added
    # tokens ("[CLS] [SEP]") or, False, writes one right after another ("[CLS][SEP]").
    spaces_between_special_tokens: bool = True
    # vLLM's detokenize: False leaves the output text "" and every logprob's decoded_token None
    # (token ids only), and takes no stop strings (they are matched on the text).
    detokenize: bool = True
    # (token id, bias) pairs sorted by token id; a dict or Map is accepted and normalised.
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # Only these ids can be sampled: every other logit is -inf before sampling (vLLM's allowed
    # token ids, applied first, before bad words, min_tokens, logit_bias and penalties).
    allowed_token_ids: tuple[int, ...] | None = None
    # Words never to generate (vLLM): each is tokenized, with and without a leading space, into
    # token sequences, and a sequence's last token is banned whenever the output so far ends with
    # the rest of it (a one-token word is always banned).
    bad_words: tuple[str, ...] | None = None
    # The token sequences of `bad_words`, set by the shell's input processor (vLLM's
    # update_from_tokenizer), never by a caller: the sampler reads these, not the words.
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # Compute every prompt token even where the prefix cache holds it (the request still writes
    # its blocks to the cache). None: only when prompt logprobs are asked for, as in vLLM (a hit
    # would skip the positions whose logprobs must be returned). `Request` resolves it.
    skip_reading_prefix_cache: bool | None = None
    # vLLM's logprob_token_ids: each position's logprobs are the sampled token's and these ids'
    # (in this order, ranked 1..n as vLLM ranks them), in place of the top-k; `logprobs`, if
    # also given, must equal their count. The input processor resolves logprobs to the count.
    logprob_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        own = "SamplingParams"
        set_ = object.__setattr__
        if not _is_int(self.n) or self.n < 1:
            raise _bad(own, "n", self.n, "an int >= 1")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise _bad(own, "temperature", self.temperature, f"a float in [0, {MAX_TEMPERATURE:g}]")
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:  # only 0 itself is greedy, as in vLLM
            set_(self, "temperature", MIN_SAMPLING_TEMPERATURE)
        if self.n > 1 and self.temperature < _GREEDY_EPS:
            # vLLM refuses it: greedy samples would all be the same completion.
            raise _bad(own, "n", self.n, "1 with greedy sampling (temperature=0)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad(own, "top_p", self.top_p, "a float in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad(own, "top_k", self.top_k, "an int >= 1, or 0 / -1 to disable")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad(own, "min_p", self.min_p, "a float in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise _bad(own, name, value, "a float in [-2, 2]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad(own, "repetition_penalty", self.repetition_penalty, "a float > 0")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad(own, "seed", self.seed, "an int or None")
        if self.seed == -1:  # vLLM's "no seed"
            set_(self, "seed", None)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad(own, "max_tokens", self.max_tokens, "an int >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad(own, "min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(own, "min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or not all(isinstance(s, str) and s for s in stop):
            raise _bad(own, "stop", self.stop, "a non-empty string or a sequence of them")
        set_(self, "stop", tuple(stop))
        if self.stop and self.detokenize is False:
            raise _bad(own, "stop", list(self.stop), "no stop strings with detokenize=False")
        set_(self, "stop_token_ids", _int_tuple(own, "stop_token_ids", self.stop_token_ids))
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _bad(own, name, getattr(self, name), "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # vLLM reads True as 1 and False as 0 (own logprob only)
                set_(self, name, value := int(value))
            if value is not None and (not _is_int(value) or value < -1):
                raise _bad(
                    own, name, value, "an int >= 0 (number of top logprobs), -1 (all) or None"
                )
        if self.logit_bias is not None:
            set_(self, "logit_bias", _normalise_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _int_tuple(own, "allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                # vLLM refuses it too: an empty set leaves nothing to sample.
                raise _bad(own, "allowed_token_ids", self.allowed_token_ids, "at least one id")
            set_(self, "allowed_token_ids", allowed)
        if self.bad_words is not None:
            set_(self, "bad_words", _words(self.bad_words))
        if self.bad_words_token_ids is not None:
            set_(self, "bad_words_token_ids", _word_ids(self.bad_words_token_ids, self.bad_words))
        if self.logprob_token_ids is not None:
            self._check_logprob_token_ids(own)
        skip = self.skip_reading_prefix_cache
        if skip is not None and not isinstance(skip, bool):
            raise _bad(own, "skip_reading_prefix_cache", skip, "a bool or None")
        if skip is False and self.prompt_logprobs is not None:
            # vLLM allows it and returns logprobs only for the positions it computed; vlax
            # refuses rather than return fewer entries than prompt tokens.
            raise _bad(
                own,
                "skip_reading_prefix_cache",
                skip,
                f"True or None with prompt_logprobs={self.prompt_logprobs} (every prompt "
                "position must be computed to return its logprob)",
            )

    def _check_logprob_token_ids(self, own: str) -> None:
        ids = _int_tuple(own, "logprob_token_ids", self.logprob_token_ids)
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise _bad(
                own,
                "logprob_token_ids",
                f"<{len(ids)} ids>",
                f"at most {MAX_LOGPROB_TOKEN_IDS} ids",
            )
        if self.logprobs is not None and self.logprobs != len(ids):
            # vLLM's rule: both name how many logprobs each position returns.
            raise _bad(
                own,
                "logprobs",
                self.logprobs,
                f"None or len(logprob_token_ids)={len(ids)} when logprob_token_ids is given",
            )
        # An empty list asks for nothing, as in vLLM (its num_logprobs is then None).
        object.__setattr__(self, "logprob_token_ids", ids or None)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_logprobs(self) -> int | None:
        """Logprobs returned per output position besides the sampled token's: `logprobs`, else
        the number of logprob_token_ids (vLLM's num_logprobs)."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None


def _normalise_bias(value: object) -> tuple[tuple[int, float], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    expected = "a mapping or pairs of (token id: int >= 0, bias: finite float)"
    if not isinstance(pairs, Iterable):
        raise _bad("SamplingParams", "logit_bias", value, expected)
    out = {}
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise _bad("SamplingParams", "logit_bias", value, expected)
        token, bias = pair
        if not _is_int(token) or token < 0 or not _is_real(bias) or token in out:
            raise _bad("SamplingParams", "logit_bias", value, expected + ", ids unique")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _words(value: object) -> tuple[str, ...]:
    expected = "a sequence of words (str), each with text other than whitespace"
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise _bad("SamplingParams", "bad_words", value, expected + " (one word: [word])")
    words = tuple(value)
    for word in words:
        # vLLM strips a word's leading whitespace before tokenizing it: nothing may be left.
        if not isinstance(word, str) or not word.strip():
            raise _bad("SamplingParams", "bad_words", value, f"{expected} (bad item {word!r})")
    return words


def _word_ids(value: object, words: tuple[str, ...] | None) -> tuple[tuple[int, ...], ...]:
    own = "SamplingParams"
    if not words:
        raise _bad(
            own, "bad_words_token_ids", value, "None: the input processor sets it from bad_words"
        )
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise _bad(own, "bad_words_token_ids", value, "a sequence of token id sequences")
    out = tuple(_int_tuple(own, "bad_words_token_ids", seq) for seq in value)
    if not all(out):
        raise _bad(own, "bad_words_token_ids", value, "non-empty token id sequences")
    return out


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One multimodal item: its encoder output fills `num_embeds` placeholder tokens at `offset`."""

    content_hash: str
    offset: int
    num_embeds: int

    def __post_init__(self) -> None:
        own = "MultiModalInput"
        if not isinstance(self.content_hash, str) or not self.content_hash:
            raise _bad(own, "content_hash", self.content_hash, "a non-empty str")
        if not _is_int(self.offset) or self.offset < 0:
            raise _bad(own, "offset", self.offset, "an int >= 0")
        if not _is_int(self.num_embeds) or self.num_embeds < 1:
            raise _bad(own, "num_embeds", self.num_embeds, "an int >= 1")

    @property
    def end(self) -> int:
        return self.offset + self.num_embeds


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Reserved for KV load jobs: waiting until remote KV has arrived.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    # The shell could not serve it (the runner or the detokenizer failed on this request).
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = SamplingParams()
    # Every id that ends the request as EOS (unless ignore_eos), resolved once by the shell's input
    # processor; the first is the one vLLM calls the EOS (a stop on it reports no stop_reason).
    # min_tokens holds all of them back.
    eos_token_ids: tuple[int, ...] = ()
    # Wall time or engine step; only its order matters (FCFS and priority ties).
    arrival_time: float = 0.0
    # Lower is more urgent (vLLM semantics).
    priority: int = 0
    mm_inputs: tuple[MultiModalInput, ...] = ()
    lora_name: str | None = None
    cache_salt: str | None = None
    output_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Hash chain of the full blocks of all its tokens (filled by the scheduler).
    block_hashes: tuple[BlockHash, ...] = ()
    stop_reason: int | str | None = None
    finish_reason: FinishReason | None = None
    # A pooling request (embed, classify, score, encode), resolved for its task: prefill-only,
    # it finishes in the step that computes its last prompt token, with the pooled output, and
    # never decodes. None: a generate request (its sampling_params apply).
    pooling_params: PoolingParams | None = None
    # Whether admission ignores prefix-cache hits and KV-store loads: decided once, from the
    # sampling parameters (see SamplingParams.skip_reading_prefix_cache), or for a pooling
    # request from its pooling parameters.
    skip_reading_prefix_cache: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        own = f"Request({self.request_id!r})"
        set_ = object.__setattr__
        if not isinstance(self.request_id, str) or not self.request_id:
            raise _bad("Request", "request_id", self.request_id, "a non-empty str")
        prompt = _int_tuple(own, "prompt_token_ids", self.prompt_token_ids)
        if not prompt:
            raise _bad(own, "prompt_token_ids", self.prompt_token_ids, "at least one token id")
        set_(self, "prompt_token_ids", prompt)
        set_(self, "output_token_ids", _int_tuple(own, "output_token_ids", self.output_token_ids))
        if not isinstance(self.sampling_params, SamplingParams):
            raise _bad(own, "sampling_params", self.sampling_params, "a SamplingParams")
        set_(self, "eos_token_ids", _int_tuple(own, "eos_token_ids", self.eos_token_ids))
        if not _is_real(self.arrival_time):
            raise _bad(own, "arrival_time", self.arrival_time, "a finite number")
        if not _is_int(self.priority):
            raise _bad(own, "priority", self.priority, "an int (lower is more urgent)")
        set_(self, "mm_inputs", _check_mm_inputs(own, self.mm_inputs, len(prompt)))
        for name in ("lora_name", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise _bad(own, name, value, "a str or None")
        if not isinstance(self.status, RequestStatus):
            raise _bad(own, "status", self.status, "a RequestStatus")
        for name in ("num_computed_tokens", "num_preemptions"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise _bad(own, name, value, "an int >= 0")
        if self.num_computed_tokens > self.num_tokens:
            raise _bad(
                own, "num_computed_tokens", self.num_computed_tokens, f"<= {self.num_tokens}"
            )
        set_(self, "block_hashes", tuple(self.block_hashes))
        if self.finish_reason is not None and not isinstance(self.finish_reason, FinishReason):
            raise _bad(own, "finish_reason", self.finish_reason, "a FinishReason or None")
        pooling = self.pooling_params
        if pooling is not None:
            if not isinstance(pooling, PoolingParams) or pooling.task is None:
                raise _bad(
                    own,
                    "pooling_params",
                    pooling,
                    "None or a PoolingParams resolved for its task (PoolingParams.verify)",
                )
            set_(self, "skip_reading_prefix_cache", bool(pooling.skip_reading_prefix_cache))
            return
        params = self.sampling_params
        skip = params.skip_reading_prefix_cache
        set_(self, "skip_reading_prefix_cache", params.prompt_logprobs is not None or bool(skip))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.output_token_ids


def _check_mm_inputs(owner: str, value: object, prompt_len: int) -> tuple[MultiModalInput, ...]:
    if not isinstance(value, Iterable):
        raise _bad(owner, "mm_inputs", value, "a sequence of MultiModalInput")
    items = tuple(value)
    end = 0
    for item in items:
        if not isinstance(item, MultiModalInput):
            raise _bad(owner, "mm_inputs", value, f"MultiModalInput items (bad item {item!r})")
        if item.offset < end:
            raise _bad(owner, "mm_inputs", value, "placeholders sorted by offset, not overlapping")
        end = item.end
    if end > prompt_len:
        raise _bad(owner, "mm_inputs", value, f"placeholders inside the {prompt_len}-token prompt")
    return items


_new = object.__new__
_set = object.__setattr__
_KEEP: object = object()


def evolve(
    request: Request,
    *,
    output_token_ids: tuple[int, ...] = _KEEP,
    status: RequestStatus = _KEEP,
    num_computed_tokens: int = _KEEP,
    num_preemptions: int = _KEEP,
    block_hashes: tuple[BlockHash, ...] = _KEEP,
    stop_reason: int | str | None = _KEEP,
    finish_reason: FinishReason | None = _KEEP,
) -> Request:
    """`request` with some of its progress fields changed, without re-validation.

    Only the scheduler calls it, with values it derived from a valid request. It is several
    times cheaper than `dataclasses.replace` (every running request changes every step), which
    is why it spells every field out: attribute access by name is what makes generic copies slow.
    """
    r = request
    out = _new(Request)
    _set(out, "request_id", r.request_id)
    _set(out, "prompt_token_ids", r.prompt_token_ids)
    _set(out, "sampling_params", r.sampling_params)
    _set(out, "eos_token_ids", r.eos_token_ids)
    _set(out, "arrival_time", r.arrival_time)
    _set(out, "priority", r.priority)
    _set(out, "mm_inputs", r.mm_inputs)
    _set(out, "lora_name", r.lora_name)
    _set(out, "cache_salt", r.cache_salt)
    _set(
        out,
        "output_token_ids",
        r.output_token_ids if output_token_ids is _KEEP else output_token_ids,
    )
    _set(out, "status", r.status if status is _KEEP else status)
    _set(
        out,
        "num_computed_tokens",
        r.num_computed_tokens if num_computed_tokens is _KEEP else num_computed_tokens,
    )
    _set(out, "num_preemptions", r.num_preemptions if num_preemptions is _KEEP else num_preemptions)
    _set(out, "block_hashes", r.block_hashes if block_hashes is _KEEP else block_hashes)
    _set(out, "stop_reason", r.stop_reason if stop_reason is _KEEP else stop_reason)
    _set(out, "finish_reason", r.finish_reason if finish_reason is _KEEP else finish_reason)
    _set(out, "pooling_params", r.pooling_params)
    _set(out, "skip_reading_prefix_cache", r.skip_reading_prefix_cache)
    return out
