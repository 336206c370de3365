"""ModelConfig: what the engine needs to know about a checkpoint, read from its config.json.

Architecture comes from `architectures` through model/registry.py; the runner type ("generate" or
"pooling") from configuration attributes (the architecture's head and what its registry entry
serves), never from isinstance checks on model classes.
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
# Architecture-name heads that end in a token distribution; everything else serves pooling.
_GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
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

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: str = "auto", runner: str = "auto"
    ) -> ModelConfig:
        path = os.fspath(path)
        hf = _read_json(os.path.join(path, "config.json"), required=True)
        gen = _read_json(os.path.join(path, "generation_config.json"), required=False) or {}
        return from_hf_dict(hf, gen, path=path, dtype=dtype, runner=runner)


def from_hf_dict(
    hf: dict, gen: dict | None = None, *, path: str = "", dtype: str = "auto", runner: str = "auto"
) -> ModelConfig:
    gen = gen or {}
    _refuse_unserved(hf, path)
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
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{path}: hidden_act {act!r} is not supported (expected 'silu')")
    num_layers = _positive_int(hf, "num_hidden_layers", path)
    max_pos = _positive_int(hf, "max_position_embeddings", path)
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
    return ModelConfig(
        path=path,
        architecture=arch,
        model_type=hf.get("model_type", ""),
        runner_type=_runner_type(arch, runner, path),
        dtype=_dtype(hf, dtype, path),
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
        hf_config=_freeze(hf),
    )


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


def _runner_type(arch: str, runner: str, path: str) -> str:
    serves = registry.lookup(arch).runner_types
    if runner == "auto":
        wanted = "generate" if arch.endswith(_GENERATIVE_SUFFIXES) else "pooling"
        return wanted if wanted in serves else serves[0]
    if runner not in RUNNER_TYPES:
        raise ConfigError(f"runner must be 'auto' or one of {RUNNER_TYPES}, got {runner!r}")
    if runner not in serves:
        raise ConfigError(f"{path}: {arch} serves runner types {serves}, not {runner!r}")
    return runner


def _dtype(hf: dict, dtype: str, path: str) -> str:
    if dtype == "auto":
        # transformers 5.x writes `dtype`; older checkpoints carry `torch_dtype`.
        found = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if found not in DTYPES:
            raise ConfigError(
                f"{path}: checkpoint dtype {found!r} is not supported; pass dtype= one of {DTYPES}"
            )
        return found
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
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
        # DeepSeek-V3.2's DSA layers attend over the whole context (through an indexer's top-k).
        if t in ("full_attention", "indexed_attention"):
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
                "'sliding_attention' or 'indexed_attention'"
            )
    return tuple(out)


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return immutables.Map({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v
