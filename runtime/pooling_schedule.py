"""How a pooling model is scheduled: whether its prompts may be chunked and read the prefix cache.

vLLM's rule (ModelConfig.is_chunked_prefill_supported / is_prefix_caching_supported for pooling
models): only a causal model pooling its LAST token supports both. Its last token has seen the
whole prompt whichever chunk computes it, and its KV is the same whoever computed the prefix.
A bidirectional model's every token attends to every other, so a chunk would attend to part of
its prompt only and a cached prefix would hold keys computed without the rest: its prompts are
computed whole, in one step (admitted only when the whole prompt fits the step's token budget),
and never read from or written to the prefix cache. MEAN and CLS pooling need every token of the
prompt in one step too (the runner pools within a step).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from model.config import ConfigError, ModelConfig
from runtime.config import EngineConfig

log = logging.getLogger(__name__)


def whole_prompts(model_config: ModelConfig) -> str | None:
    """Why this pooling model's prompts must be computed whole, or None when they may be chunked
    and hit the prefix cache."""
    if model_config.attention_type != "causal":
        return f"its attention is {model_config.attention_type}"
    if model_config.pooling_type != "LAST":
        return f"it pools with {model_config.pooling_type}, which needs every token in one step"
    return None


def pooling_engine_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """`config` with chunked prefill and prefix caching turned off where the model needs whole
    prompts (logged once, with the reason), or refused where a knob would split them."""
    reason = whole_prompts(model_config)
    if reason is None:
        return config
    arch = model_config.architecture
    if config.long_prefill_token_threshold:
        raise ConfigError(
            f"long_prefill_token_threshold={config.long_prefill_token_threshold} would split "
            f"prompts into chunks, and {arch} computes every prompt whole ({reason}); leave it 0"
        )
    if config.kv_offload is not None:
        raise ConfigError(
            f"kv_offload={config.kv_offload!r} stores and loads prefix KV, and {arch} keeps no "
            f"reusable prefix ({reason}); run it without kv_offload"
        )
    if config.enable_chunked_prefill or config.enable_prefix_caching:
        log.info(
            "%s: chunked prefill and prefix caching are off: %s, so each prompt is computed "
            "whole in one step (admitted only when it fits max_num_batched_tokens)",
            arch,
            reason,
        )
    return replace(config, enable_chunked_prefill=False, enable_prefix_caching=False)
