"""HF `architectures` names -> model families: the one way the runner reaches a model's code.

Built-in families are named by "module.path:ClassName" and imported lazily, so config parsing imports
no model code. A family outside the project (a plugin, a test) joins with `register`, and is then served
like a built-in one; every family implements the protocol of model/base.py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchitectureEntry:
    name: str  # the HF `architectures` entry
    target: str | type  # "module.path:ClassName", or the class itself
    runner_types: tuple[str, ...]  # what this class can serve: "generate" and/or "pooling"


# A decoder served with runner="pooling" embeds by its last token (model/routing.py).
_BUILT_IN = (
    ArchitectureEntry("LlamaForCausalLM", "model.llama:LlamaForCausalLM", ("generate", "pooling")),
    ArchitectureEntry("Qwen2ForCausalLM", "model.llama:Qwen2ForCausalLM", ("generate", "pooling")),
    ArchitectureEntry("Qwen3ForCausalLM", "model.llama:Qwen3ForCausalLM", ("generate", "pooling")),
    ArchitectureEntry(
        "DeepseekV3ForCausalLM", "model.deepseek:DeepseekV3ForCausalLM", ("generate",)
    ),
    ArchitectureEntry(
        "DeepseekV32ForCausalLM", "model.deepseek_v32:DeepseekV32ForCausalLM", ("generate",)
    ),
    ArchitectureEntry(
        "KimiLinearForCausalLM", "model.kimi_linear:KimiLinearForCausalLM", ("generate",)
    ),
    ArchitectureEntry("GemmaForCausalLM", "model.gemma:GemmaForCausalLM", ("generate",)),
    ArchitectureEntry(
        "PaliGemmaForConditionalGeneration",
        "model.paligemma:PaliGemmaForConditionalGeneration",
        ("generate",),
    ),
    # Multi-vector retrieval: one L2-normalised vector per token (late interaction).
    ArchitectureEntry("ColPaliForRetrieval", "model.paligemma:ColPaliForRetrieval", ("pooling",)),
    # Encoders: no language-model head, bidirectional attention, no KV cache.
    ArchitectureEntry("BertModel", "model.bert:BertModel", ("pooling",)),
    ArchitectureEntry(
        "BertForSequenceClassification", "model.bert:BertForSequenceClassification", ("pooling",)
    ),
)
_REGISTRY = {e.name: e for e in _BUILT_IN}
_RUNNER_TYPES = ("generate", "pooling")
# The class-level members of model/base.py's protocol the runner calls; a family that serves the
# generate runner also computes logits.
_PROTOCOL = ("hf_weight_specs", "hf_ignored_weight", "cache_specs")
_GENERATE_PROTOCOL = ("compute_logits",)


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def lookup(name: str) -> ArchitectureEntry | None:
    return _REGISTRY.get(name)


def register(name: str, target: str | type, runner_types: tuple[str, ...]) -> ArchitectureEntry:
    """Serve checkpoints whose `architectures` names `name` with `target`'s family.

    Replacing a built-in architecture is refused, so a plugin cannot silently change what a
    Llama checkpoint runs; registering the same name twice with another target is refused too.
    """
    if not isinstance(target, type) and ":" not in str(target):
        raise ValueError(f"target must be a class or 'module.path:ClassName', got {target!r}")
    bad = [t for t in runner_types if t not in _RUNNER_TYPES]
    if not runner_types or bad:
        raise ValueError(
            f"runner_types must be a non-empty subset of {_RUNNER_TYPES}, got {runner_types!r}"
        )
    entry = ArchitectureEntry(name, target, tuple(runner_types))
    old = _REGISTRY.get(name)
    if old is not None and old != entry:
        raise ValueError(f"architecture {name!r} is already registered to {old.target!r}")
    _REGISTRY[name] = entry
    return entry


def unregister(name: str) -> None:
    """Forget a family added with `register` (built-in ones stay)."""
    if any(e.name == name for e in _BUILT_IN):
        raise ValueError(f"{name!r} is built in and cannot be unregistered")
    if name not in _REGISTRY:
        raise ValueError(f"architecture {name!r} is not registered")
    del _REGISTRY[name]


def model_class(name: str) -> type:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}"
        )
    if isinstance(entry.target, type):
        cls = entry.target
    else:
        module, _, attr = entry.target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    protocol = _PROTOCOL + (_GENERATE_PROTOCOL if "generate" in entry.runner_types else ())
    missing = [m for m in protocol if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"{cls.__qualname__} (registered for {name!r}) lacks {', '.join(missing)} of the model "
            "protocol in model/base.py"
        )
    return cls
