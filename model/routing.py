"""Which runner serves a checkpoint, how it pools, and how its layers attend: decided from
configuration attributes and sentence-transformers files, never from model classes.

vLLM PR 52425 is the failure this rules out: its runner found encoder-only models by `isinstance`
over registered modules, a check that one backend's module layout silently defeated, so BERT-like
models ran as causal. Here every decision reads `config.json` (`architectures`, `model_type`,
`is_decoder`, `is_causal`, `id2label`) and the sentence-transformers files next to it
(`modules.json`, the Pooling module's `config.json`, `sentence_bert_config.json`), and records the
attribute that decided it, so the engine can log each decision once with its reason.

Rules, in order (runner="auto"):
  runner:    explicit runner > a `*ForSequenceClassification` head > a sentence-transformers
             Pooling module > encoder-only attention > a language-model head > what the
             architecture serves.
  pooling:   (pooling runner only) a classification head pools its first token (an encoder) or
             its last (a decoder); else the Pooling module's mode; else an encoder's first
             ([CLS]) token, as vLLM's BertEmbeddingModel; else (causal) the last token, the only
             one that has seen the whole prompt (Qwen3-Embedding).
  attention: an encoder model type attends bidirectionally unless `is_decoder` is true; every
             other served model type is a causal decoder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import immutables

from model.config import RUNNER_TYPES, ConfigError

POOLING_TYPES = ("MEAN", "CLS", "LAST")
ATTENTION_TYPES = ("causal", "bidirectional")
# model_type values whose self-attention is bidirectional unless `is_decoder` says otherwise
# (HF builds their attention masks from that flag, not from the class).
ENCODER_MODEL_TYPES = frozenset({"bert"})
# Architecture-name heads that end in a token distribution.
GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
CLASSIFICATION_SUFFIX = "ForSequenceClassification"

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers Pooling flags vlax serves, and the pooling type each means.
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}
_UNSERVED_POOLING_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
# The newer single-key form ("pooling_mode": "mean").
_POOLING_MODE_NAMES = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}


@dataclass(frozen=True, slots=True)
class SentenceTransformers:
    """What a checkpoint's sentence-transformers files say (each file is optional)."""

    modules: tuple[str, ...]  # modules.json's module types, in order
    pooling: immutables.Map | None  # the Pooling module's config.json
    pooling_file: str  # where `pooling` was read from, for messages
    max_seq_length: int | None  # sentence_bert_config.json


@dataclass(frozen=True, slots=True)
class Routing:
    runner_type: str  # "generate" | "pooling"
    pooling_type: str | None  # "MEAN" | "CLS" | "LAST"; None for the generate runner
    attention_type: str  # "causal" | "bidirectional"
    normalize: bool  # L2-normalise pooled embeddings by default
    max_seq_length: int | None
    num_labels: int | None  # classification heads only
    # "runner" / "pooling_type" / "attention_type" / "normalize" -> the attribute that decided it
    reasons: immutables.Map


def read_sentence_transformers(path: str) -> SentenceTransformers | None:
    """The sentence-transformers files in checkpoint directory `path`; None when it has none."""
    modules_file = os.path.join(path, "modules.json")
    bert_file = os.path.join(path, "sentence_bert_config.json")
    if not os.path.exists(modules_file) and not os.path.exists(bert_file):
        return None
    modules = _read(modules_file, list) or []
    types, pooling, pooling_file = [], None, ""
    for i, module in enumerate(modules):
        if not isinstance(module, dict) or not isinstance(module.get("type"), str):
            raise ConfigError(f"{modules_file}: entry {i} must be an object with a 'type' string")
        types.append(module["type"])
        if module["type"] == _ST_POOLING:
            pooling_file = os.path.join(path, module.get("path", ""), "config.json")
            found = _read(pooling_file, dict)
            if found is None:
                raise ConfigError(
                    f"{modules_file} declares {_ST_POOLING} at {module.get('path')!r} but "
                    f"{pooling_file} does not exist"
                )
            pooling = immutables.Map(found)
    bert = _read(bert_file, dict) or {}
    max_len = bert.get("max_seq_length")
    if max_len is not None and (
        not isinstance(max_len, int) or isinstance(max_len, bool) or max_len <= 0
    ):
        raise ConfigError(f"{bert_file}: max_seq_length must be a positive int, got {max_len!r}")
    return SentenceTransformers(tuple(types), pooling, pooling_file, max_len)


def _read(file: str, kind: type):
    if not os.path.exists(file):
        return None
    with open(file) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, kind):
        raise ConfigError(f"{file} must hold a JSON {kind.__name__}, got {type(data).__name__}")
    return data


def route(
    hf: dict,
    arch: str,
    serves: tuple[str, ...],
    runner: str,
    path: str,
    st: SentenceTransformers | None = None,
) -> Routing:
    """The routing of a checkpoint whose config.json is `hf`, served as `arch` (which serves the
    runner types `serves`), with `runner` "auto" or one of RUNNER_TYPES."""
    attention, attention_why = _attention_type(hf, path)
    runner_type, runner_why = _runner_type(
        hf, arch, serves, runner, path, st, attention, attention_why
    )
    reasons = {"runner": runner_why, "attention_type": attention_why}
    classifies = arch.endswith(CLASSIFICATION_SUFFIX)
    pooling_type = normalize = num_labels = None
    if runner_type == "pooling":
        pooling_type, reasons["pooling_type"] = _pooling_type(arch, classifies, attention, st)
        normalize, reasons["normalize"] = _normalize(arch, classifies, st)
        num_labels = _num_labels(hf, path) if classifies else None
    return Routing(
        runner_type=runner_type,
        pooling_type=pooling_type,
        attention_type=attention,
        normalize=bool(normalize),
        max_seq_length=None if st is None else st.max_seq_length,
        num_labels=num_labels,
        reasons=immutables.Map(reasons),
    )


def describe(reasons: immutables.Map, runner_type: str, pooling_type, attention_type) -> str:
    """The routing in one line, each decision with the attribute that decided it."""
    parts = [f"runner {runner_type} ({reasons['runner']})"]
    if pooling_type is not None:
        parts.append(f"pooling {pooling_type} ({reasons['pooling_type']})")
    parts.append(f"attention {attention_type} ({reasons['attention_type']})")
    if "normalize" in reasons:
        parts.append(f"normalize: {reasons['normalize']}")
    return "; ".join(parts)


def _attention_type(hf: dict, path: str) -> tuple[str, str]:
    model_type = hf.get("model_type")
    if hf.get("add_cross_attention"):
        raise ConfigError(
            f"{path}: config field 'add_cross_attention' is true: cross-attention (an "
            "encoder-decoder) is not served"
        )
    if model_type in ENCODER_MODEL_TYPES:
        if hf.get("is_decoder"):
            return "causal", f"model_type={model_type!r} with is_decoder=true"
        return "bidirectional", f"model_type={model_type!r} is an encoder and is_decoder is not set"
    if model_type == "colpali":
        # HF's ColPali processor marks every token of a page or query as prefix (token_type_ids
        # all 0), so PaliGemma's prefix-LM mask makes the whole input bidirectional.
        return "bidirectional", (
            "model_type='colpali' embeds its whole input as PaliGemma's bidirectional prefix"
        )
    if hf.get("is_causal") is False:
        raise ConfigError(
            f"{path}: config field 'is_causal' = false asks for bidirectional attention in a "
            f"{model_type!r} decoder, which vlax does not serve (its decoders attend causally)"
        )
    return "causal", f"model_type={model_type!r} is a decoder"


def _runner_type(hf, arch, serves, runner, path, st, attention, attention_why) -> tuple[str, str]:
    if runner != "auto":
        if runner not in RUNNER_TYPES:
            raise ConfigError(f"runner must be 'auto' or one of {RUNNER_TYPES}, got {runner!r}")
        if runner not in serves:
            raise ConfigError(_unserved_runner(arch, serves, runner, path, attention_why))
        return runner, f"runner={runner!r} was asked for"
    if arch.endswith(CLASSIFICATION_SUFFIX):
        wanted, why = "pooling", f"architectures names {arch!r}, a sequence-classification head"
    elif st is not None and _ST_POOLING in st.modules:
        wanted, why = "pooling", f"modules.json declares {_ST_POOLING}"
    elif attention == "bidirectional":
        wanted, why = "pooling", f"encoder-only: {attention_why}"
    elif arch.endswith(GENERATIVE_SUFFIXES):
        wanted, why = "generate", f"architectures names {arch!r}, a language-model head"
    else:
        return serves[0], f"architectures names {arch!r}, which serves only {serves[0]!r}"
    if wanted not in serves:
        raise ConfigError(
            f"{path}: {why}, so runner 'auto' means {wanted!r}, but {arch} serves runner types "
            f"{serves}; pass runner={serves[0]!r} to serve it that way"
        )
    return wanted, why


def _unserved_runner(arch, serves, runner, path, attention_why) -> str:
    if runner == "generate":
        return (
            f"{path}: {arch} serves runner types {serves}, not 'generate': it has no "
            f"language-model head ({attention_why}); it embeds, classifies and scores: use "
            "runner='pooling' (or 'auto') and LLM.embed / classify / score / encode"
        )
    return (
        f"{path}: {arch} serves runner types {serves}, not 'pooling': vlax has no pooling path "
        "for this architecture; use runner='generate' (or 'auto')"
    )


def _pooling_type(arch, classifies, attention, st) -> tuple[str, str]:
    if classifies:
        if attention == "bidirectional":
            return "CLS", f"{arch} classifies the first ([CLS]) token through its pooler"
        return "LAST", f"{arch} classifies the last token (causal attention)"
    if st is not None and st.pooling is not None:
        return _st_pooling_type(st)
    if attention == "bidirectional":
        return "CLS", (
            "no sentence-transformers Pooling module: an encoder pools its first ([CLS]) token "
            "(vLLM's BertEmbeddingModel default)"
        )
    return "LAST", (
        "no sentence-transformers Pooling module and causal attention: only the last token "
        "has seen the whole prompt"
    )


def _st_pooling_type(st: SentenceTransformers) -> tuple[str, str]:
    cfg, where = st.pooling, st.pooling_file
    name = cfg.get("pooling_mode")
    if isinstance(name, str):
        if name not in _POOLING_MODE_NAMES:
            raise ConfigError(
                f"{where}: pooling_mode {name!r} is not served; served: "
                f"{sorted(_POOLING_MODE_NAMES)}"
            )
        return _POOLING_MODE_NAMES[name], f"{where}: pooling_mode={name!r}"
    unserved = [k for k in _UNSERVED_POOLING_MODES if cfg.get(k)]
    if unserved:
        raise ConfigError(
            f"{where}: {', '.join(f'{k}=true' for k in unserved)} is not served; vlax pools by "
            f"{', '.join(_POOLING_MODES)}"
        )
    on = [k for k in _POOLING_MODES if cfg.get(k)]
    if len(on) != 1:
        raise ConfigError(
            f"{where}: exactly one of {', '.join(_POOLING_MODES)} must be true (vlax does not "
            f"concatenate poolings), got {on or 'none'}"
        )
    return _POOLING_MODES[on[0]], f"{where}: {on[0]}=true"


def _normalize(arch, classifies, st) -> tuple[bool, str]:
    if classifies:
        return False, f"{arch} returns class scores, not embeddings"
    if st is not None and st.modules:
        if _ST_NORMALIZE in st.modules:
            return True, f"modules.json declares {_ST_NORMALIZE}"
        return False, f"modules.json declares no {_ST_NORMALIZE}"
    return True, "no sentence-transformers modules: embeddings are L2-normalised (vLLM's default)"


def _num_labels(hf: dict, path: str) -> int:
    # HF derives num_labels from id2label; a config saved without one means its default of 2.
    id2label = hf.get("id2label")
    n = len(id2label) if isinstance(id2label, dict) and id2label else hf.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ConfigError(f"{path}: num_labels must be a positive int, got {n!r}")
    return n
