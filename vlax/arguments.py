"""Checks on what a caller hands `LLM` and `vlax generate`, made before JAX is imported.

Each error names the bad value and what would be accepted. This module imports nothing heavy, so the
CLI reports a bad argument in a fraction of a second instead of after JAX's start-up.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping

from runtime.config import ConfigError
from runtime.core.request import SamplingParams

# vLLM arguments that vlax answers under another name: the hint says which.
_VLLM_EQUIVALENTS = {
    "gpu_memory_utilization": "vlax sizes the KV cache with kv_cache_bytes or num_kv_blocks",
}


def check_keywords(owner: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """TypeError for the first name in `given` that `owner` does not take, with the nearest
    accepted names (or all of them when none is near)."""
    accepted = sorted(set(accepted))
    for name in given:
        if name in accepted:
            continue
        near = difflib.get_close_matches(name, accepted, n=3)
        if name in _VLLM_EQUIVALENTS:
            advice = f" ({_VLLM_EQUIVALENTS[name]})"
        elif near:
            advice = f"; did you mean {' or '.join(repr(n) for n in near)}?"
        else:
            advice = f"; accepted: {', '.join(accepted)}"
        raise TypeError(f"{owner} got an unexpected keyword argument {name!r}{advice}")


def checkpoint_dir(model: object) -> str:
    """`model` as a path to an existing folder; vlax serves local checkpoints only."""
    if not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be a checkpoint folder (a str or path) or None, got {model!r}")
    path = os.fspath(model)
    if not os.path.exists(path):
        raise ConfigError(
            f"model {path!r} does not exist: pass a local Hugging Face checkpoint folder "
            "(vlax downloads nothing), or no model for the embedded default"
        )
    if not os.path.isdir(path):
        raise ConfigError(
            f"model {path!r} is a file: pass the checkpoint folder that holds its config.json"
        )
    return path


def per_prompt_params(sampling_params: object, num_prompts: int) -> list[SamplingParams]:
    """vLLM's `sampling_params` argument (one SamplingParams, or one per prompt) as a list. The
    caller resolves None first: the defaults come from the checkpoint (`LLM.generate_iter`)."""
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, Mapping):
        raise TypeError(
            "sampling_params must be a SamplingParams, not a dict: "
            f"write SamplingParams(**{dict(sampling_params)!r})"
        )
    if isinstance(sampling_params, str) or not isinstance(sampling_params, Iterable):
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them (one per prompt), "
            f"got {type(sampling_params).__name__} {sampling_params!r}"
        )
    params = list(sampling_params)
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(
                f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__} {p!r}"
            )
    if len(params) != num_prompts:
        raise ValueError(
            f"got {len(params)} SamplingParams for {num_prompts} prompts; "
            "pass one, or one per prompt"
        )
    return params
