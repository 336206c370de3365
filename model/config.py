"""ModelConfig: what the engine needs to know about a checkpoint, read from its config.json.

Architecture comes from `architectures` through model/registry.py; the runner type ("generate" or
"pooling"), pooling type and attention type from configuration attributes and sentence-transformers
files (model/routing.py), never from isinstance checks on model classes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import immutables

from model import registry

# The dtypes vlax serves a model in: the one list (EngineConfig and `vlax generate --dtype` take
# "auto", meaning the checkpoint's own, or one of these).
DTYPES = ("float32", "bfloat16", "float16")
RUNNER_TYPES = ("generate", "pooling")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# hidden_act values each model type is served with (others: silu only). BERT's "gelu" is the exact
# (erf) GELU; "gelu_new" and "gelu_pytorch_tanh" its tanh approximation.
_ACTIVATIONS = {
    "bert": ("gelu", "gelu_new", "gelu_pytorch_tanh"),
    "gemma": ("gelu_pytorch_tanh",),
    "paligemma": ("gelu_pytorch_tanh",),
    "colpali": ("gelu_pytorch_tanh",),
}
# HF GemmaConfig's defaults for keys a PaliGemma checkpoint's text_config may leave out
# (google/paligemma-3b-pt-224 gives neither head_dim nor max_position_embeddings).
_GEMMA_DEFAULTS = dict(
    head_dim=256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
# The keys vLLM takes from generation_config.json as sampling defaults.
_GENERATION_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


class ConfigError(ValueError):
    """A setting vlax cannot serve, or one that contradicts itself: a checkpoint's configuration,
    an engine knob (runtime/config.py) or an `LLM` argument. The project's one ConfigError, so a
    caller catches one class: it lives here, in the lowest layer that raises it, and runtime and
    vlax import it. The pure core imports nothing from the project and raises its own
    SchedulerConfigError, which the engine turns into this one."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str
    architecture: str
    model_type: str
    runner_type: str
    dtype: str  # one of DTYPES: the dtype weights and activations are kept in
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # Llama's flag: bias on q, k, v and o projections
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    generation_defaults: immutables.Map
    hf_config: immutables.Map  # the whole config.json, frozen, for family-specific keys
    hidden_act: str = "silu"
    # Routing (model/routing.py), each decided from configuration attributes.
    pooling_type: str | None = None  # "MEAN" | "CLS" | "LAST"; None for the generate runner
    attention_type: str = "causal"  # "causal" | "bidirectional", for every layer
    normalize: bool = False  # pooled embeddings L2-normalised by default
    max_seq_length: int | None = None  # sentence_bert_config.json's, when the checkpoint has one
    num_labels: int | None = None  # classification heads only
    # "runner" / "pooling_type" / "attention_type" / "normalize" -> the attribute that decided it
    routing_reasons: immutables.Map = immutables.Map()

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    @property
    def max_model_len(self) -> int:
        # A sentence-transformers checkpoint was trained to its max_seq_length (all-MiniLM-L6-v2:
        # 256 of 512 positions); vLLM caps the model length there too.
        if self.max_seq_length is not None:
            return min(self.max_seq_length, self.max_position_embeddings)
        return self.max_position_embeddings

    def describe_routing(self) -> str:
        """Runner, pooling and attention type, each with the attribute that decided it (the line
        the engine logs once)."""
        from model.routing import describe

        return describe(
            self.routing_reasons, self.runner_type, self.pooling_type, self.attention_type
        )

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: str = "auto", runner: str = "auto"
    ) -> ModelConfig:
        from model.routing import read_sentence_transformers

        path = os.fspath(path)
        hf = _read_json(os.path.join(path, "config.json"), required=True)
        gen = _read_json(os.path.join(path, "generation_config.json"), required=False) or {}
        st = read_sentence_transformers(path)
        return from_hf_dict(
            hf, gen, path=path, dtype=dtype, runner=runner, sentence_transformers=st
        )


def from_hf_dict(
    hf: dict,
    gen: dict | None = None,
    *,
    path: str = "",
    dtype: str = "auto",
    runner: str = "auto",
    sentence_transformers=None,
) -> ModelConfig:
    """`sentence_transformers`: the checkpoint's model.routing.SentenceTransformers files, if any."""
    # routing.py raises this module's ConfigError, so it is imported here, not at the top.
    from model.routing import route

    gen = gen or {}
    _refuse_unserved(hf, path)
    whole, hf = hf, _language_view(hf, path)
    arch = _architecture(hf, path)
    num_heads = _positive_int(hf, "num_attention_heads", path)
    hidden = _positive_int(hf, "hidden_size", path)
    num_kv = hf.get("num_key_value_heads")
    num_kv = num_heads if num_kv is None else num_kv
    if not isinstance(num_kv, int) or isinstance(num_kv, bool) or num_kv <= 0:
        raise ConfigError(f"{path}: num_key_value_heads must be a positive int, got {num_kv!r}")
    if num_heads % num_kv:
        raise ConfigError(
            f"{path}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv})"
        )
    # HF's Qwen3Config defaults head_dim to 128, not hidden / heads: a config.json without it
    # means 128, as it does for transformers and vLLM.
    head_dim = hf.get("head_dim", 128 if hf.get("model_type") == "qwen3" else None)
    if head_dim is None:
        if hidden % num_heads:
            raise ConfigError(
                f"{path}: hidden_size ({hidden}) is not divisible by num_attention_heads "
                f"({num_heads}) and config has no head_dim"
            )
        head_dim = hidden // num_heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"{path}: head_dim must be a positive even int, got {head_dim!r}")
    act = _activation(hf, path)
    num_layers = _positive_int(hf, "num_hidden_layers", path)
    # Kimi's hub configs name the context length `model_max_length` (HF maps it the same way).
    max_pos_key = (
        "model_max_length"
        if "max_position_embeddings" not in hf and "model_max_length" in hf
        else "max_position_embeddings"
    )
    max_pos = _positive_int(hf, max_pos_key, path)
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
    routing = route(
        hf, arch, registry.lookup(arch).runner_types, runner, path, sentence_transformers
    )
    return ModelConfig(
        path=path,
        architecture=arch,
        model_type=hf.get("model_type", ""),
        runner_type=routing.runner_type,
        dtype=_dtype(hf, dtype, path, pooling=routing.runner_type == "pooling"),
        vocab_size=_positive_int(hf, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_positive_int(hf, "intermediate_size", path),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope=_rope(hf, head_dim, max_pos, path),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        sliding_windows=_sliding_windows(hf, num_layers, path),
        bos_token_id=gen.get("bos_token_id", hf.get("bos_token_id")),
        eos_token_ids=eos_ids,
        pad_token_id=gen.get("pad_token_id", hf.get("pad_token_id")),
        generation_defaults=immutables.Map(
            {k: gen[k] for k in _GENERATION_DEFAULT_KEYS if gen.get(k) is not None}
        ),
        hf_config=_freeze(whole),
        hidden_act=act,
        pooling_type=routing.pooling_type,
        attention_type=routing.attention_type,
        normalize=routing.normalize,
        max_seq_length=routing.max_seq_length,
        num_labels=routing.num_labels,
        routing_reasons=routing.reasons,
    )


def _language_view(hf: dict, path: str) -> dict:
    """The settings of the language model. A PaliGemma checkpoint nests them in text_config (its
    top-level hidden_size is a leftover default, not the model's), ColPali one level deeper, in
    vlm_config; their architectures, model_type and dtype stay the checkpoint's own."""
    model_type = hf.get("model_type")
    if model_type not in ("paligemma", "colpali"):
        return hf
    vlm = hf.get("vlm_config") if model_type == "colpali" else hf
    where = "vlm_config.text_config" if model_type == "colpali" else "text_config"
    text = vlm.get("text_config") if isinstance(vlm, dict) else None
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: a {model_type!r} checkpoint needs {where}")
    if text.get("model_type", "gemma") != "gemma":
        raise ConfigError(
            f"{path}: {where}.model_type = {text.get('model_type')!r}: only a 'gemma' language "
            "model is served (PaliGemma 2's gemma2 is not)"
        )
    view = {**_GEMMA_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if view.get("hidden_act") == "gelu":  # HF's GemmaConfig reads the legacy "gelu" as tanh
        view["hidden_act"] = "gelu_pytorch_tanh"
    for key in ("architectures", "model_type", "dtype", "torch_dtype"):
        if key in hf:
            view[key] = hf[key]
    # Hub PaliGemma checkpoints give the special tokens at the top level only.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if view.get(key) is None and vlm.get(key) is not None:
            view[key] = vlm[key]
    return view


def _read_json(file: str, *, required: bool) -> dict | None:
    if not os.path.exists(file):
        if required:
            raise ConfigError(f"no config.json in checkpoint directory {os.path.dirname(file)!r}")
        return None
    with open(file) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


# Checkpoints that look close to a served family but are not served: refused by name before the
# architecture lookup, so the error says what is missing rather than "unsupported architecture".
_UNSERVED_MODEL_TYPES = {
    "deepseek_v4": "DeepSeek-V4 is not served (vlax serves DeepSeek-V3 'deepseek_v3' and "
    "DeepSeek-V3.2 'deepseek_v32')",
}
_UNSERVED_ARCHITECTURES = {"DeepseekV4ForCausalLM": _UNSERVED_MODEL_TYPES["deepseek_v4"]}


def _refuse_unserved(hf: dict, path: str) -> None:
    model_type = hf.get("model_type")
    if model_type in _UNSERVED_MODEL_TYPES:
        raise ConfigError(
            f"{path}: config field 'model_type' = {model_type!r}: {_UNSERVED_MODEL_TYPES[model_type]}"
        )
    for name in hf.get("architectures") or []:
        if name in _UNSERVED_ARCHITECTURES:
            raise ConfigError(
                f"{path}: config field 'architectures' names {name!r}: {_UNSERVED_ARCHITECTURES[name]}"
            )
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        what = "FP8 weights have" if str(method).lower().startswith("fp8") else "it has"
        raise ConfigError(
            f"{path}: config field 'quantization_config.quant_method' = {method!r}: quantized "
            f"checkpoints are not served ({what} no dequantization path in vlax); use a checkpoint "
            "with float32, bfloat16 or float16 weights"
        )


def _positive_int(hf: dict, key: str, path: str) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{path}: config field {key!r} must be a positive int, got {v!r}")
    return v


def _architecture(hf: dict, path: str) -> str:
    archs = hf.get("architectures") or []
    for name in archs:
        if registry.lookup(name) is not None:
            return name
    raise ConfigError(
        f"{path}: unsupported architecture(s) {archs!r}; "
        f"supported: {', '.join(registry.supported_architectures())}"
    )


def _activation(hf: dict, path: str) -> str:
    model_type = hf.get("model_type")
    served = _ACTIVATIONS.get(model_type, ("silu",))
    act = hf.get("hidden_act", served[0])
    if act not in served:
        raise ConfigError(
            f"{path}: hidden_act {act!r} is not supported for model_type {model_type!r} "
            f"(expected {' or '.join(repr(a) for a in served)})"
        )
    return act


# vLLM 0.33's model types that float16 makes numerically unstable (config/model.py).
FLOAT16_UNSTABLE = ("gemma2", "gemma3", "gemma3_text", "glm4")


def checkpoint_dtype(hf: dict) -> str:
    """The dtype a checkpoint's config.json declares (float32 when it declares none)."""
    # transformers 5.x writes `dtype`; older checkpoints carry `torch_dtype`.
    return hf.get("dtype") or hf.get("torch_dtype") or "float32"


def _dtype(hf: dict, dtype: str, path: str, *, pooling: bool) -> str:
    """vLLM 0.33's choice (config/model.py _get_and_verify_dtype, its platforms' bfloat16,
    float16, float32 order): "auto" keeps a bfloat16 or float16 checkpoint's dtype and
    downcasts a float32 one, to float16 for a pooling model and bfloat16 otherwise; a model
    type float16 makes unstable never gets it (auto takes bfloat16, an explicit float16 is
    refused)."""
    model_type = hf.get("model_type", "")
    unstable = model_type in FLOAT16_UNSTABLE
    if dtype == "auto":
        found = checkpoint_dtype(hf)
        if found not in DTYPES:
            raise ConfigError(
                f"{path}: checkpoint dtype {found!r} is not supported; pass dtype= one of {DTYPES}"
            )
        preferred = "float16" if pooling and not unstable else "bfloat16"
        return preferred if found == "float32" or (found == "float16" and unstable) else found
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    if dtype == "float16" and unstable:
        raise ConfigError(
            f"{path}: model_type {model_type!r} does not support float16 (numerical "
            "instability, as vLLM refuses it); use bfloat16 or float32"
        )
    return dtype


def _rope(hf: dict, head_dim: int, max_pos: int, path: str) -> RopeConfig:
    # transformers 5.x: `rope_parameters` (holding rope_theta); older: `rope_scaling` + `rope_theta`.
    p = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{path}: rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}"
        )
    partial = p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(
            f"{path}: partial_rotary_factor {partial} is not supported (expected 1.0)"
        )
    theta = float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))
    common = dict(
        rope_type=rope_type, theta=theta, head_dim=head_dim, max_position_embeddings=max_pos
    )
    if rope_type == "default":
        return RopeConfig(**common)
    factor = _rope_number(p, "factor", None, rope_type, path)
    if factor is None and rope_type != "yarn":
        raise ConfigError(f"{path}: rope_type {rope_type!r} needs a 'factor'")
    orig = int(
        hf.get(
            "original_max_position_embeddings", p.get("original_max_position_embeddings", max_pos)
        )
    )
    if rope_type == "yarn" and factor is None:
        factor = max_pos / orig
    if factor < 1.0 and rope_type != "linear":
        raise ConfigError(f"{path}: rope factor must be >= 1 for {rope_type!r}, got {factor}")
    common.update(factor=float(factor), original_max_position_embeddings=orig)
    if rope_type == "llama3":
        return RopeConfig(
            **common,
            low_freq_factor=_rope_number(p, "low_freq_factor", _REQUIRED, rope_type, path),
            high_freq_factor=_rope_number(p, "high_freq_factor", _REQUIRED, rope_type, path),
        )
    if rope_type == "yarn":
        return RopeConfig(
            **common,
            beta_fast=float(p.get("beta_fast") or 32.0),
            beta_slow=float(p.get("beta_slow") or 1.0),
            attention_factor=p.get("attention_factor"),
            mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"),
            truncate=bool(p.get("truncate", True)),
        )
    return RopeConfig(**common)


_REQUIRED = object()


def _rope_number(p: dict, key: str, default, rope_type: str, path: str):
    """A number from the rope parameters as a float; `default` when absent (`_REQUIRED`: refused)."""
    value = p.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{path}: rope_type {rope_type!r} needs {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: rope {key!r} must be a number, got {value!r}")
    return float(value)


def _sliding_windows(hf: dict, num_layers: int, path: str) -> tuple[int | None, ...]:
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return (None,) * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"{path}: layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    out = []
    for i, t in enumerate(layer_types):
        # DeepSeek-V3.2's DSA layers attend over the whole context (through an indexer's top-k);
        # Kimi-Linear's KDA layers keep a recurrent state instead of a window.
        if t in ("full_attention", "indexed_attention", "linear_attention"):
            out.append(None)
        elif t == "sliding_attention":
            if not isinstance(window, int) or window <= 0:
                raise ConfigError(
                    f"{path}: layer {i} is sliding_attention but sliding_window={window!r}"
                )
            out.append(window)
        else:
            raise ConfigError(
                f"{path}: layer_types[{i}] = {t!r}; expected 'full_attention', "
                "'sliding_attention', 'indexed_attention' or 'linear_attention'"
            )
    return tuple(out)


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return immutables.Map({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v
