"""Before the core: tokenize a prompt, resolve EOS ids and generation defaults, validate a request.

Everything a request carries is checked here, once, against the model (every token id against the
vocabulary, lengths against max_model_len, logprobs against the vocabulary size), and a bad
request is refused with an error that names the value, before anything is scheduled: a request
the core admits can never fail inside a step for something its caller wrote. `process` is pure,
so the engine can prepare a whole batch and admit it only when every request of it is good.

EOS ids are resolved once per model, from the checkpoint's config.json, its generation_config.json
and the tokenizer (all of them). The tokenizer's is the one vLLM calls the EOS (a stop on it
reports no stop_reason; the others report their id, as vLLM's generation-config EOS ids do), so it
comes first. Generation defaults follow vLLM's `get_diff_sampling_param`: generation_config.json's
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) make the
default SamplingParams, used where the caller passes none; a caller's SamplingParams is used as
it is (vLLM's `LLM.generate` does the same), except that its `bad_words` are tokenized here, once,
into the `bad_words_token_ids` the sampler reads (vLLM's `update_from_tokenizer`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from model.config import ModelConfig
from runtime.config import ConfigError
from runtime.core.request import Request, SamplingParams
from runtime.multimodal.image_processor import PreprocessMemo
from runtime.multimodal.image_prompt import (
    ImagePrompt,
    build_image_prompt,
    image_spec,
    images_of,
    prefix_salt,
)
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
_GENERATION_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A validated request: what the output processor reports, and the core requests to admit
    (one per sample: n > 1 fans out into children with their own ids and seeds)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    children: tuple[Request, ...]
    # Each image's preprocessed pixels, index-aligned with every child's mm_inputs: the shell
    # keeps them for the runner's vision tower (the core sees only hashes and placeholders).
    pixel_values: tuple = ()


def resolve_eos_token_ids(
    model_config: ModelConfig, tokenizer: Tokenizer | None
) -> tuple[int, ...]:
    """Every EOS id of the model: the tokenizer's first, then config.json's and
    generation_config.json's; ids outside the vocabulary (a broken checkpoint) are left out."""
    found = model_config.hf_config.get("eos_token_id")
    config = () if found is None else (found,) if isinstance(found, int) else tuple(found)
    from_tokenizer = () if tokenizer is None else (tokenizer.eos_token_id,)
    ids = [t for t in (*from_tokenizer, *config, *model_config.eos_token_ids) if t is not None]
    vocab = model_config.vocab_size
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        log.warning(
            "%s: EOS id(s) %s are outside the vocabulary [0, %d) and are ignored",
            model_config.path,
            outside,
            vocab,
        )
    return tuple(dict.fromkeys(t for t in ids if 0 <= t < vocab))


def bad_words_token_ids(
    tokenizer: Tokenizer, words: tuple[str, ...], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """The token sequences vLLM bans for `words` (SamplingParams.update_from_tokenizer): each word,
    its leading whitespace stripped, tokenized as it is and with a space before it (a word at the
    start of the text and one in the middle are often different tokens). The spaced form is kept
    only when its first token differs and it has as many tokens as the unspaced one. Raises
    ValueError naming a word the tokenizer turns into no tokens or into ids outside the model's
    vocabulary (a tokenizer may know more ids than the model has rows)."""
    out = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words holds {word!r}, which the tokenizer turns into no tokens")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        found = [plain]
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
        for ids in found:
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise ValueError(
                    f"bad_words holds {word!r}, which tokenizes to {list(ids)}: token id "
                    f"{outside[0]}, outside the vocabulary [0, {vocab_size})"
                )
        out.extend(found)
    return tuple(out)


def default_sampling_params(model_config: ModelConfig) -> SamplingParams:
    """vLLM's defaults: SamplingParams() with generation_config.json's sampling values over it."""
    given = model_config.generation_defaults
    values = {_GENERATION_DEFAULTS[k]: v for k, v in given.items() if k in _GENERATION_DEFAULTS}
    if not values:
        return SamplingParams()
    try:
        params = SamplingParams(**values)
    except ValueError as err:
        raise ConfigError(
            f"{model_config.path}: generation_config.json sets sampling defaults vLLM would "
            f"apply, but they are not valid: {err}"
        ) from None
    log.info("sampling defaults from generation_config.json: %s", values)
    return params


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        *,
        max_logprobs: int = 20,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        # vLLM's rule: -1 allows the whole vocabulary.
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else max_logprobs
        self.eos_token_ids = resolve_eos_token_ids(model_config, tokenizer)
        self.default_params = default_sampling_params(model_config)
        self.architecture, self.path = model_config.architecture, model_config.path
        # None for a model that takes no images.
        self.image_spec = image_spec(
            model_config.architecture, model_config.hf_config, model_config.path
        )
        # A batch usually shares one SamplingParams: tokenize its bad words once, and hand every
        # request the same resolved object (the runner computes per-params constants once).
        self._with_bad_words = functools.lru_cache(maxsize=256)(self._resolve_bad_words)
        self._with_all_logprobs = functools.lru_cache(maxsize=256)(self._resolve_all_logprobs)

    def prompt_inputs(self, prompt: object) -> tuple[str | None, list[int]]:
        """(text, token ids) of a vLLM-style prompt: a str, or a dict with 'prompt_token_ids'
        (and optionally 'prompt', the text they came from) or 'prompt'."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
                    raise TypeError(f"prompt_token_ids must be a list of ints, got {ids!r}")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self.prompt_inputs(str(prompt["prompt"]))
        raise TypeError(
            f"a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}"
        )

    def image_prompt(
        self, prompt: object, own: str, memo: PreprocessMemo | None = None
    ) -> tuple[str | None, ImagePrompt]:
        """`prompt_inputs` for a prompt that may carry multi_modal_data: its text and its token
        ids with its images' placeholders (an image model's text prompt gets its '\\n'); `memo`
        holds what its batch's earlier prompts preprocessed."""
        images = []
        if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
            images = images_of(prompt["multi_modal_data"], own)
        spec = self.image_spec
        if images and spec is None:
            raise ValueError(
                f"{own}: multi_modal_data holds {len(images)} image(s), but {self.architecture} "
                f"({self.path}) takes no images"
            )
        if isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = str(prompt["prompt"])
        if spec is not None and isinstance(prompt, str):
            # HF's PaliGemma processor ends every prefix with "\n" (and vLLM's does the same).
            prompt = prompt if prompt.endswith("\n") else prompt + "\n"
        text, ids = self.prompt_inputs(prompt)
        return text, build_image_prompt(spec, own, ids, images, memo)

    def process(
        self,
        request_id: str,
        prompt_token_ids,
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float = 0.0,
        images: ImagePrompt | None = None,
    ) -> ProcessedRequest:
        """Validate one request and build its core requests; raises ValueError / TypeError naming
        the bad value (the request id first) and changes nothing."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r}: expected a non-empty str")
        own = f"request {request_id!r}"
        if params is None:
            params = self.default_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{own}: params must be a SamplingParams, got {params!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"{own}: priority must be an int, got {priority!r}")
        ids = self._prompt_ids(own, prompt_token_ids)
        mm_inputs = ()
        if images is not None:
            if tuple(images.token_ids) != ids:
                raise ValueError(f"{own}: the image prompt's token ids are not the prompt's")
            mm_inputs = images.mm_inputs
        self._check_params(own, params, len(ids))
        # An image model's prompt is one bidirectional prefix: a prefix hit needs all of it.
        salt = None if self.image_spec is None else prefix_salt(ids, mm_inputs)
        if params.bad_words:
            try:
                params = self._with_bad_words(params)
            except ValueError as err:
                raise ValueError(f"{own}: {err}") from None
        if -1 in (params.logprobs, params.prompt_logprobs):
            params = self._with_all_logprobs(params)
        children = []
        for i in range(params.n):
            child = params
            if params.n > 1:
                # Each sample its own seed (vLLM's ParentRequest: seed + index).
                child = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            children.append(
                Request(
                    request_id if params.n == 1 else f"{request_id}.{i}",
                    ids,
                    child,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival_time,
                    priority=priority,
                    mm_inputs=mm_inputs,
                    cache_salt=salt,
                )
            )
        pixels = () if images is None else images.pixel_values
        return ProcessedRequest(request_id, prompt, ids, params, tuple(children), pixels)

    def _prompt_ids(self, own: str, prompt_token_ids) -> tuple[int, ...]:
        if isinstance(prompt_token_ids, str | bytes) or not hasattr(prompt_token_ids, "__iter__"):
            raise TypeError(
                f"{own}: prompt_token_ids must be a list of ints, got {prompt_token_ids!r}"
            )
        ids = tuple(prompt_token_ids)
        if not ids:
            raise ValueError(f"{own}: the prompt is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                raise TypeError(f"{own}: prompt token id {t!r} is not an int")
        ids = tuple(int(t) for t in ids)
        self._check_ids(own, "prompt token id", ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{own}: the prompt has {len(ids)} tokens, which leaves no room to generate "
                f"within max_model_len={self.max_model_len} (at most {self.max_model_len - 1} "
                "prompt tokens)"
            )
        return ids

    def _check_params(self, own: str, params: SamplingParams, prompt_len: int) -> None:
        # max_tokens past what max_model_len leaves is not refused: as vLLM 0.33's offline path,
        # the core ends such a request at max_model_len with finish reason "length".
        vocab = self.vocab_size
        self._check_ids(own, "stop_token_ids holds token id", params.stop_token_ids)
        self._check_ids(own, "logit_bias holds token id", [t for t, _ in params.logit_bias or ()])
        self._check_ids(own, "allowed_token_ids holds token id", params.allowed_token_ids or ())
        self._check_ids(own, "logprob_token_ids holds token id", params.logprob_token_ids or ())
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            count = vocab if value == -1 else value  # -1: every token, as in vLLM
            if count is not None and count > vocab:
                raise ValueError(
                    f"{own}: {name}={value} asks for more top tokens than the vocabulary has "
                    f"({vocab})"
                )
            if count is not None and count > self.max_logprobs:
                raise ValueError(
                    f"{own}: {name}={value} asks for {count} top logprobs, more than "
                    f"max_logprobs={self.max_logprobs} (LLM(max_logprobs=...) raises it; -1: the "
                    "whole vocabulary)"
                )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"{own}: stop={list(params.stop)} needs a tokenizer to detokenize the output, "
                "and this checkpoint has none; stop on token ids with stop_token_ids"
            )
        if params.bad_words and self.tokenizer is None:
            raise ValueError(
                f"{own}: bad_words={list(params.bad_words)} needs a tokenizer to turn the words "
                "into token ids, and this checkpoint has none; restrict token ids with "
                "allowed_token_ids or lower them with logit_bias"
            )

    def _resolve_all_logprobs(self, params: SamplingParams) -> SamplingParams:
        """`params` with a logprobs count of -1 (every token) as the vocabulary's size."""
        vocab = self.vocab_size
        return replace(
            params,
            logprobs=vocab if params.logprobs == -1 else params.logprobs,
            prompt_logprobs=vocab if params.prompt_logprobs == -1 else params.prompt_logprobs,
        )

    def _resolve_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with the token sequences of its bad words, each id checked."""
        sequences = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size)
        if sequences == params.bad_words_token_ids:
            return params
        return replace(params, bad_words_token_ids=sequences)

    def _check_ids(self, own: str, what: str, ids) -> None:
        vocab = self.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise ValueError(f"{own}: {what} {t}, outside the vocabulary [0, {vocab})")
