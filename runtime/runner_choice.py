"""The errors for calling an API the checkpoint's runner does not serve: each names the runner the
checkpoint got, the attribute that decided it, and how to choose the other (`runner=`)."""

from __future__ import annotations

from model import registry
from model.config import ModelConfig


def _got(model_config: ModelConfig) -> str:
    reason = model_config.routing_reasons.get("runner")
    why = f", decided by {reason}" if reason else ""
    return (
        f"{model_config.path} ({model_config.architecture}) got runner "
        f"{model_config.runner_type!r}{why}"
    )


def generate_on_pooling(model_config: ModelConfig) -> str:
    """LLM.generate() on a checkpoint served by the pooling runner."""
    serves = registry.lookup(model_config.architecture).runner_types
    if "generate" in serves:
        advice = "pass LLM(model, runner='generate') to serve it as a generative model"
    else:
        advice = (
            f"{model_config.architecture} has no language-model head and serves only runner "
            "'pooling': use LLM.embed / classify / score / encode, or a causal LM checkpoint"
        )
    return f"LLM.generate() needs a generative model, but {_got(model_config)}; {advice}"


def pooling_on_generate(model_config: ModelConfig, api: str) -> str:
    """LLM.embed() (classify, score, encode) on a checkpoint served by the generate runner."""
    serves = registry.lookup(model_config.architecture).runner_types
    if "pooling" in serves:
        advice = (
            "pass LLM(model, runner='pooling') to serve it as an embedding model (last-token "
            "pooling, normalized, as Qwen3-Embedding)"
        )
    else:
        advice = f"{model_config.architecture} serves only runner 'generate'"
    return f"LLM.{api}() needs a pooling model, but {_got(model_config)}; {advice}"
