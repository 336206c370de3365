"""A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, with the special
tokens, BOS/EOS policy and chat template from `tokenizer_config.json` (and its side files)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import immutables
from tokenizers import Tokenizer as _Backend

from runtime.chat_template import render_chat_template

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")  # fmt: skip


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or unusable."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as strings or as serialised AddedTokens.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _find_chat_template(path: Path, config: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template")
    template = template if template is not None else config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Encode / decode / chat-template rendering for one checkpoint."""

    path: Path
    backend: _Backend
    special_tokens: Mapping[str, str]  # "bos_token" -> "<s>", ... as templates see them
    add_bos_token: bool | None  # None: the tokenizer.json post-processor decides
    add_eos_token: bool
    chat_template: str | None
    # Read once: every request's detokenizer asks, and the backend builds its added-token table
    # anew on each call (~130 us with Llama 3's 256 special tokens).
    all_special_ids: frozenset[int] = field(init=False, repr=False, compare=False)
    # Every added token's text by id (special or not): detokenizers under
    # spaces_between_special_tokens=False emit these as they are.
    added_token_contents: Mapping[int, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        added = self.backend.get_added_tokens_decoder()
        special = frozenset(i for i, t in added.items() if t.special)
        object.__setattr__(self, "all_special_ids", special)
        contents = MappingProxyType({i: t.content for i, t in added.items()})
        object.__setattr__(self, "added_token_contents", contents)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json (a fast tokenizer file is required)")
        backend = _Backend.from_file(str(file))
        # Padding and truncation baked into tokenizer.json (all-MiniLM-L6-v2: fixed 128) are
        # dropped, as HF's fast tokenizers drop them on every call that asks for neither: a prompt
        # keeps all its tokens, and the input processor checks its length against the model's
        # max_model_len (a sentence-transformers checkpoint's max_seq_length), refusing or
        # truncating it as the request says.
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(path / "tokenizer_config.json")
        side = _read_json(path / "special_tokens_map.json")
        special = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(config.get(key)) or _token_text(side.get(key))
            if text is not None:
                if backend.token_to_id(text) is None:
                    raise TokenizerError(f"{path}: {key} {text!r} is not in the vocabulary")
                special[key] = text
        add_bos = config.get("add_bos_token")
        return cls(
            path=path,
            backend=backend,
            special_tokens=immutables.Map(special),
            add_bos_token=None if add_bos is None else bool(add_bos),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_find_chat_template(path, config),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the checkpoint's config says
        (`add_bos_token` / `add_eos_token`, else the tokenizer.json post-processor)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if not add_special_tokens:
            return self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token is None:
            return self.backend.encode(text, add_special_tokens=True).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos, eos = self.bos_token_id, self.eos_token_id
        if self.add_bos_token and bos is not None:
            ids = [bos, *ids]
        if self.add_eos_token and eos is not None:
            ids = [*ids, eos]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation; encode it with `add_special_tokens=False`, since
        templates write their own BOS."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise TokenizerError(
                f"{self.path}: the checkpoint has no chat template (looked for chat_template.jinja, "
                "chat_template.json and 'chat_template' in tokenizer_config.json); pass "
                "chat_template=... or send a plain prompt instead of messages"
            )
        return render_chat_template(
            template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
