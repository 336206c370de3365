"""Render a checkpoint's Jinja chat template the way transformers' `apply_chat_template` does.

Templates from checkpoints are untrusted code, hence the sandboxed environment; the environment
options, filters and globals match transformers so rendered prompts are identical.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which changes prompts; transformers overrides it.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for `messages` (dicts with at least 'role' and 'content')."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{i}]={message!r}: expected a mapping with a 'role' key")
    return _compile(template).render(
        messages=[dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **{**special_tokens, **kwargs},
    )
