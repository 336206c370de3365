"""safetensors checkpoint -> (graphdef, state) of the model class the config names.

Tensors are matched by their on-disk HF names (single `model.safetensors` or shards listed in
`model.safetensors.index.json`). Every missing, unexpected or mis-shaped tensor is reported by name in
one error before anything is loaded. Reads with `safe_open(framework="np")`; numpy has no bfloat16,
so BF16 tensors are read from their byte range in the file as ml_dtypes.bfloat16.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from model import registry
from model.base import ModelOptions
from model.config import ConfigError, ModelConfig
from model.weight_spec import WeightSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_NON_NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16}
_SERVED_FLOAT_DTYPES = ("F16", "F32", "F64")  # safetensors tags starting with F; BF16 is served too


class LoadError(ValueError):
    """A checkpoint whose tensors do not match what the configuration says the model has."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype tag, e.g. "F32", "BF16"


def checkpoint_files(path: str) -> tuple[str, ...]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index} has no 'weight_map'")
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise LoadError(f"{index} names shard files that do not exist: {missing}")
        return tuple(files)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return (single,)
    raise LoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path!r}")


def list_tensors(path: str) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in out:
                    raise LoadError(f"tensor {name!r} is stored twice: {out[name].file} and {file}")
                sl = f.get_slice(name)
                out[name] = TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
    return out


def _read_header(file: str) -> tuple[int, dict]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


class _Reader:
    """Reads tensors by name, keeping each file open once."""

    def __init__(
        self,
        tensors: dict[str, TensorInfo],
        stack: contextlib.ExitStack,
        stored: dict[str, str] | None = None,
    ):
        self._tensors = tensors
        self._stack = stack
        self._stored = stored or {}  # spec name -> the alias it is stored under
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}

    def get(self, name: str) -> np.ndarray:
        info = self._tensors[name]
        name = self._stored.get(name, name)
        if info.dtype in _NON_NUMPY_DTYPES:
            if info.file not in self._headers:
                self._headers[info.file] = _read_header(info.file)
            base, header = self._headers[info.file]
            begin, end = header[name]["data_offsets"]
            raw = np.fromfile(info.file, dtype=np.uint8, count=end - begin, offset=base + begin)
            return raw.view(_NON_NUMPY_DTYPES[info.dtype]).reshape(info.shape)
        if info.file not in self._handles:
            self._handles[info.file] = self._stack.enter_context(
                safe_open(info.file, framework="np")
            )
        return self._handles[info.file].get_tensor(name)


def apply_aliases(
    model_cls: type, config: ModelConfig, tensors: dict[str, TensorInfo]
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors under the names the weight specs use, {spec name: on-disk alias}).

    A family may declare `hf_weight_aliases(config) -> {spec name: alias}`: another spelling the
    same tensor is stored under (Kimi-Linear's dense MLP is `mlp.*` in hub checkpoints and
    `block_sparse_moe.*` when transformers 5 saved it). A spec name missing from the checkpoint is
    read from its alias when that is there."""
    aliases = getattr(model_cls, "hf_weight_aliases", None)
    if aliases is None:
        return tensors, {}
    stored = {
        name: alias
        for name, alias in aliases(config).items()
        if name not in tensors and alias in tensors
    }
    moved = set(stored.values())
    out = {n: t for n, t in tensors.items() if n not in moved}
    out.update({name: tensors[alias] for name, alias in stored.items()})
    return out, stored


def check_tensors(model_cls: type, config: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    expected = {
        name: shape for spec in model_cls.hf_weight_specs(config) for name, shape in spec.sources
    }
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(
        n for n in tensors if n not in expected and not model_cls.hf_ignored_weight(n, config)
    )
    misshaped = sorted(
        f"{n}: expected {expected[n]}, found {tensors[n].shape}"
        for n in expected
        if n in tensors and tensors[n].shape != expected[n]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {'; '.join(misshaped)}")
    if problems:
        raise LoadError(
            f"checkpoint {config.path!r} does not match {config.architecture}:\n  "
            + "\n  ".join(problems)
        )


def check_float_dtypes(config: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    """Refuse low-precision float tensors (FP8 "F8_E4M3", ...) before anything else: their scales
    would otherwise be reported as unexpected tensors, and vlax has no dequantization path."""
    low = sorted(
        (n, t.dtype)
        for n, t in tensors.items()
        if t.dtype.startswith("F") and t.dtype not in _SERVED_FLOAT_DTYPES
    )
    if low:
        shown = ", ".join(f"{n} ({d})" for n, d in low[:3])
        raise ConfigError(
            f"checkpoint {config.path!r}: {len(low)} tensors are stored as "
            f"{', '.join(sorted({d for _, d in low}))}, e.g. {shown}: FP8 (and other "
            "low-precision float) weights have no dequantization path in vlax; use a checkpoint "
            "with F32, BF16 or F16 weights"
        )


def _join(spec: WeightSpec, parts: list[np.ndarray]) -> np.ndarray:
    """The sources side by side on the output axis (weight_spec.py)."""
    if spec.transpose:
        parts = [a.T for a in parts]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1 if spec.transpose else 0)


def _assemble(spec: WeightSpec, reader: _Reader, dtype: np.dtype) -> np.ndarray:
    parts = [reader.get(name).astype(dtype) for name, _ in spec.sources]
    if not spec.stacked:
        return _join(spec, parts)
    run = len(parts) // spec.stacked
    return np.stack([_join(spec, parts[i : i + run]) for i in range(0, len(parts), run)])


def load_model(
    path: str | os.PathLike,
    model_config: ModelConfig,
    options: ModelOptions | None = None,
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
):
    """(graphdef, state) of the config's architecture with the checkpoint's weights in config.dtype,
    built with `options` (block size, cache dtype, forced attention backend; defaults if None).
    `place(path, array)` puts each parameter on its devices as it is read (tensor parallelism:
    runtime/runner/parallel.py); by default it goes whole to the default device."""
    path = os.fspath(path)
    cls = registry.model_class(model_config.architecture)
    tensors, stored = apply_aliases(cls, model_config, list_tensors(path))
    check_float_dtypes(model_config, tensors)
    check_tensors(cls, model_config, tensors)
    options = ModelOptions() if options is None else options
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(model_config, options)))
    flat = dict(nnx.to_flat_state(abstract))
    specs = {spec.path: spec for spec in cls.hf_weight_specs(model_config)}
    if set(specs) != set(flat):
        raise RuntimeError(
            f"{cls.__name__} weight specs and parameters disagree: "
            f"{sorted(map(str, set(specs) ^ set(flat)))}"
        )
    loaded = []
    with contextlib.ExitStack() as stack:
        reader = _Reader(tensors, stack, stored)
        for p, var in flat.items():
            # Each parameter in the dtype its module declares (config.dtype, except where a
            # module keeps a part in float32, like the DeepSeek MoE router).
            arr = _assemble(specs[p], reader, np.dtype(var.dtype))
            if arr.shape != var.shape:
                raise RuntimeError(f"assembled {p} has shape {arr.shape}, expected {var.shape}")
            loaded.append((p, var.replace(jnp.asarray(arr) if place is None else place(p, arr))))
    return graphdef, nnx.from_flat_state(loaded)
