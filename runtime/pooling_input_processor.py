"""Before the core, for a pooling engine: tokenize (a text, or a cross-encoder's pair of texts),
truncate per `truncate_prompt_tokens`, resolve the PoolingParams for the task, and validate.

As the generate path's InputProcessor, `process` changes nothing and raises an error naming the
request and the bad value, so a whole batch is checked before any of it is admitted.

Truncation follows vLLM: -1 means max_model_len; a value above max_model_len is refused; a text is
truncated by its tokenizer (which keeps its special tokens: BERT's [CLS] ... [SEP]; a pair loses
tokens from its longer text first); a token-id prompt keeps its last k ids. Without truncation a
prompt longer than max_model_len is refused with both numbers and how to truncate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from model.config import ModelConfig
from runtime.core.request import PoolingParams, Request
from runtime.input_processor import ProcessedRequest
from runtime.multimodal.image_processor import PreprocessMemo
from runtime.multimodal.image_prompt import ImagePrompt, build_image_prompt, image_spec, images_of
from runtime.tokenizer import Tokenizer

# Tasks a model serves: a classification head classifies and scores pairs (a cross-encoder);
# an embedding model embeds, encodes tokens and scores pairs by cosine similarity.
CLASSIFIER_TASKS = ("classify", "score")
EMBEDDER_TASKS = ("embed", "token_embed", "score")


def supported_tasks(model_config: ModelConfig) -> tuple[str, ...]:
    return CLASSIFIER_TASKS if model_config.num_labels is not None else EMBEDDER_TASKS


class PoolingInputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        *,
        whole_prompts: bool,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        self.whole_prompts = whole_prompts
        self.tasks = supported_tasks(model_config)
        # None for a model that takes no images.
        self.image_spec = image_spec(
            model_config.architecture, model_config.hf_config, model_config.path
        )
        hf = model_config.hf_config
        dims = hf.get("matryoshka_dimensions")
        self._matryoshka = dict(
            is_matryoshka=bool(dims) or bool(hf.get("is_matryoshka", False)),
            matryoshka_dimensions=tuple(dims) if dims else None,
            hidden_size=model_config.hidden_size,
            default_normalize=model_config.normalize,
        )

    def resolve(self, params: PoolingParams | None, task: str) -> PoolingParams:
        """`params` (None: the defaults) verified for `task` on this model."""
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {params!r}")
        return params.verify(task, model=self.model_config.path, **self._matryoshka)

    def truncation(self, params: PoolingParams) -> int | None:
        """How many tokens a prompt keeps under `params` (None: all of them)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return self.max_model_len
        if k > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size."
            )
        return k

    def encode(
        self, text: str, pair: str | None = None, *, max_length: int | None = None
    ) -> tuple[list[int], int | None]:
        """(token ids, token_type_start) of a text, or of a pair of texts (the second's first
        position), tokenized and truncated as the checkpoint's tokenizer does."""
        tokenizer = self._tokenizer()
        if pair is None and max_length is None:
            return tokenizer.encode(text), None
        backend = tokenizer.backend
        saved = backend.truncation
        if max_length is not None:
            backend.enable_truncation(max_length, strategy="longest_first", direction="right")
        try:
            encoding = backend.encode(text) if pair is None else backend.encode(text, pair)
        finally:
            if saved is None:
                backend.no_truncation()
            else:
                backend.enable_truncation(**saved)
        if pair is None:
            return list(encoding.ids), None
        types = list(encoding.type_ids)
        start = types.index(1) if 1 in types else None
        if start is None or any(t != (i >= start) for i, t in enumerate(types)):
            raise ValueError(
                f"the tokenizer of {self.model_config.path} gives the pair ({text!r}, {pair!r}) "
                f"token types {types}; a cross-encoder needs 0s then 1s"
            )
        return list(encoding.ids), start

    def prompt_ids(self, prompt: object, params: PoolingParams) -> tuple[str | None, list[int]]:
        """(text, ids) of a vLLM-style prompt (str, or dict with 'prompt' or 'prompt_token_ids'),
        truncated per `params`."""
        keep = self.truncation(params)
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, max_length=keep)[0]
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
                    raise TypeError(f"prompt_token_ids must be a list of ints, got {ids!r}")
                ids = list(ids)
                return prompt.get("prompt"), ids if keep is None else ids[-keep:]
            if "prompt" in prompt:
                return self.prompt_ids(str(prompt["prompt"]), params)
        raise TypeError(
            f"a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}"
        )

    def process(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: PoolingParams,
        *,
        prompt: str | None = None,
        arrival_time: float = 0.0,
        images: ImagePrompt | None = None,
    ) -> ProcessedRequest:
        """Validate one pooling request (params already resolved by `resolve`); `images`: its
        images' placeholders and pixels (an image model's prompt, from `image_prompt`)."""
        own = f"request {request_id!r}"
        if params.task not in self.tasks:
            raise ValueError(
                f"{own}: task {params.task!r} is not served by {self.model_config.architecture} "
                f"({self.model_config.path}); it serves {list(self.tasks)}"
            )
        ids = tuple(prompt_token_ids)
        if not ids:
            raise ValueError(f"{own}: the prompt is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                raise TypeError(f"{own}: prompt token id {t!r} is not an int")
        ids = tuple(int(t) for t in ids)
        outside = [t for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(
                f"{own}: prompt token id {outside[0]}, outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) > self.max_model_len:
            whole = (
                " (this model computes a prompt whole, in one step: it is never split into chunks)"
                if self.whole_prompts
                else ""
            )
            raise ValueError(
                f"{own}: the prompt has {len(ids)} tokens, more than max_model_len="
                f"{self.max_model_len}{whole}; pass truncate_prompt_tokens=-1 to keep its first "
                f"{self.max_model_len} (or =k for k), or shorten it"
            )
        start = params.token_type_start
        if start is not None and start >= len(ids):
            raise ValueError(
                f"{own}: the pair's second text starts at token {start} of {len(ids)}: "
                "truncation left nothing of it"
            )
        mm_inputs, pixels = (), ()
        if images is not None:
            if tuple(images.token_ids) != ids:
                raise ValueError(f"{own}: the image prompt's token ids are not the prompt's")
            mm_inputs, pixels = images.mm_inputs, images.pixel_values
        request = Request(
            request_id, ids, pooling_params=params, arrival_time=arrival_time, mm_inputs=mm_inputs
        )
        return ProcessedRequest(request_id, prompt, ids, params, (request,), pixels)

    def image_prompt(
        self,
        prompt: object,
        params: PoolingParams,
        own: str,
        memo: PreprocessMemo | None = None,
    ) -> tuple[str | None, ImagePrompt]:
        """`prompt_ids` for an image model's prompt (it may carry multi_modal_data): its
        images' placeholders go first; truncation must not cut into them. `memo` holds what its
        batch's earlier prompts preprocessed."""
        images = []
        if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
            images = images_of(prompt["multi_modal_data"], own)
            prompt = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        if images and self.image_spec is None:
            raise ValueError(
                f"{own}: multi_modal_data holds {len(images)} image(s), but "
                f"{self.model_config.architecture} ({self.model_config.path}) takes no images"
            )
        if isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = str(prompt["prompt"])
        if self.image_spec is not None and isinstance(prompt, str) and not prompt.endswith("\n"):
            # PaliGemma's processor ends every prefix with "\n" (ColPali's too).
            prompt += "\n"
        text, ids = self.prompt_ids(prompt, params)
        built = build_image_prompt(self.image_spec, own, ids, images, memo)
        keep = self.truncation(params)
        if keep is not None and len(built.token_ids) > keep:
            raise ValueError(
                f"{own}: truncate_prompt_tokens={keep} would cut into the prompt's "
                f"{len(built.token_ids)} tokens, {len(images)} image(s) included; an image "
                "prompt is not truncated"
            )
        return text, built

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_config.path} has no tokenizer: pass prompts as "
                "{'prompt_token_ids': [...]}"
            )
        return self.tokenizer
