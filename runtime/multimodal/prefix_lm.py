"""How a prefix-LM vision-language model (PaliGemma) is scheduled: each prompt whole, in one step.

PaliGemma's image tokens and prompt attend to each other both ways (HF's token_type_ids == 0
prefix), so a chunk of the prompt would attend to part of it only: chunked prefill is off, and a
prompt is admitted only when the whole of it fits max_num_batched_tokens (vLLM keeps a
bidirectional multimodal span in one chunk for the same reason). The prefix cache stays on: every
block's hash includes a salt naming the whole prompt (image_prompt.prefix_salt), so a hit needs
the whole bidirectional prefix equal, and the KV it reuses is what this prompt would compute.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from model.config import ConfigError, ModelConfig
from runtime.config import EngineConfig
from runtime.multimodal.image_prompt import image_spec

log = logging.getLogger(__name__)


def prefix_lm_engine_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """`config` with chunked prefill off for an image model (logged once), or refused where a
    knob would split its prompts; other models' config as it is."""
    spec = image_spec(model_config.architecture, model_config.hf_config, model_config.path)
    if spec is None:
        return config
    arch = model_config.architecture
    if config.long_prefill_token_threshold:
        raise ConfigError(
            f"long_prefill_token_threshold={config.long_prefill_token_threshold} would split "
            f"prompts into chunks, and {arch} computes every prompt whole (its image and prompt "
            "attend to each other both ways); leave it 0"
        )
    if config.enable_chunked_prefill:
        log.info(
            "%s: chunked prefill is off: its image and prompt tokens attend to each other both "
            "ways, so each prompt is computed whole in one step (admitted only when it fits "
            "max_num_batched_tokens)",
            arch,
        )
    return replace(config, enable_chunked_prefill=False)
