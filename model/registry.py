"""HF `architectures` names -> model classes, resolved lazily so config parsing imports no model code."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchitectureEntry:
    name: str  # the HF `architectures` entry
    target: str  # "module.path:ClassName"
    runner_types: tuple[str, ...]  # what this class can serve: "generate" and/or "pooling"


_ENTRIES = (
    ArchitectureEntry("LlamaForCausalLM", "model.llama:LlamaForCausalLM", ("generate",)),
    ArchitectureEntry("Qwen2ForCausalLM", "model.llama:Qwen2ForCausalLM", ("generate",)),
    ArchitectureEntry("Qwen3ForCausalLM", "model.llama:Qwen3ForCausalLM", ("generate",)),
)
_REGISTRY = {e.name: e for e in _ENTRIES}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def lookup(name: str) -> ArchitectureEntry | None:
    return _REGISTRY.get(name)


def model_class(name: str) -> type:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}"
        )
    module, _, cls = entry.target.partition(":")
    return getattr(importlib.import_module(module), cls)
