"""What an EngineConfig means for one checkpoint, decided before anything is built.

The engine's limits (max_model_len, the token budget), whether prefix caching and async
scheduling are on, and the config a pooling or prefix-LM model needs: each decided here, once,
from the config and the checkpoint's ModelConfig, with a ConfigError naming the knob that cannot
hold and the reason logged where a default is turned off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from model import base
from model.config import ModelConfig, checkpoint_dtype
from pallas_kernels.platform import current_platform
from runtime.config import ConfigError, EngineConfig
from runtime.multimodal.prefix_lm import prefix_lm_engine_config
from runtime.pooling_schedule import pooling_engine_config
from runtime.runner.model_runner import model_cache_specs, model_options

log = logging.getLogger(__name__)

# vLLM 0.33's defaults for an offline LLM (EngineArgs.get_batch_defaults, UsageContext.LLM_CLASS):
# (max_num_batched_tokens, max_num_seqs) per device of the model's world, by platform. For GPUs
# vLLM takes 16384 / 1024 on cards of 70 GiB or more but the A100 (and on the largest); vlax
# does not read a GPU's memory, so every GPU gets the tier vLLM gives the others.
BATCH_DEFAULTS = {"cpu": (4096, 256), "gpu": (8192, 256)}
# What async_scheduling=None (the default) means where nothing refuses it. Off: on the CPU the
# "device" is the host's own cores, so the step's host work has no idle device time to hide in;
# measured interleaved on the 2-core dev machine (vlax side of offline_throughput, float32, 16
# requests, loaded) sync and async were within the load's noise of each other. vLLM turns it on
# by default for its GPUs, where the host work is otherwise a gap between device steps; measure
# there before turning it on for an accelerator.
ASYNC_BY_DEFAULT = False


@dataclass(frozen=True)
class EngineSetup:
    config: EngineConfig  # as the model needs it (pooling: whole prompts; prefix LM: no chunks)
    model_config: ModelConfig
    max_model_len: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    async_scheduling: bool


def resolve(config: EngineConfig) -> EngineSetup:
    model_config = ModelConfig.from_pretrained(
        config.model, dtype=config.dtype, runner=config.runner
    )
    # Runner, pooling and attention type, each with the attribute that decided it: once.
    log.info("%s: %s", config.model, model_config.describe_routing())
    declared = checkpoint_dtype(model_config.hf_config)
    if config.dtype == "auto" and model_config.dtype != declared:
        log.info(
            "dtype='auto': the %s checkpoint computes in %s (vLLM 0.33's rule: a float32 "
            "checkpoint is downcast, to float16 for a pooling model and bfloat16 otherwise); "
            "pass dtype=%r to keep its own",
            declared,
            model_config.dtype,
            declared,
        )
    if model_config.runner_type == "pooling":
        config = pooling_engine_config(config, model_config)
    else:
        config = prefix_lm_engine_config(config, model_config)
    max_model_len = config.max_model_len or model_config.max_model_len
    if max_model_len > model_config.max_model_len:
        cap = f"max_position_embeddings={model_config.max_position_embeddings}"
        if model_config.max_seq_length is not None:
            cap = (
                f"max_model_len={model_config.max_model_len} ({cap}, sentence-transformers "
                f"max_seq_length={model_config.max_seq_length})"
            )
        raise ConfigError(f"max_model_len={max_model_len} exceeds the checkpoint's {cap}")
    config, max_batched = _batch_limits(config, max_model_len)
    if not config.enable_chunked_prefill and max_batched < max_model_len:
        raise ConfigError(
            f"without chunked prefill max_num_batched_tokens={max_batched} must be at least "
            f"max_model_len={max_model_len}, or a long prompt could never be scheduled"
        )
    return EngineSetup(
        config,
        model_config,
        max_model_len,
        max_batched,
        enable_prefix_caching=_prefix_caching(config, model_config),
        async_scheduling=_async_scheduling(config, model_config),
    )


def _batch_limits(config: EngineConfig, max_model_len: int) -> tuple[EngineConfig, int]:
    """`config` with max_num_seqs decided, and the token budget, as vLLM 0.33 decides them
    (EngineArgs._set_default_max_num_seqs_and_batched_tokens_args): what is given stays; a
    default is the platform's per device times tensor_parallel_size, then, without chunked
    prefill, at least max_model_len, and never over max_num_seqs whole requests."""
    platform = "cpu" if current_platform() == "cpu" else "gpu"
    tokens, seqs = (n * config.tensor_parallel_size for n in BATCH_DEFAULTS[platform])
    if config.max_num_seqs is None:
        config = replace(config, max_num_seqs=seqs)
    if config.max_num_batched_tokens is not None:
        return config, config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        tokens = max(tokens, max_model_len)
    return config, min(tokens, config.max_num_seqs * max_model_len)


def _prefix_caching(config: EngineConfig, model_config: ModelConfig) -> bool:
    """For a model that keeps per-request recurrent state (state cache specs): refuse KV
    offload, and turn prefix caching off with its reason logged. Returns whether prefix
    caching is on. Decided from the family's cache specs, before any weight is loaded."""
    options = model_options(model_config, config.block_size, config.attention_backend)
    states = base.state_specs(model_cache_specs(model_config, options))
    if not states:
        return config.enable_prefix_caching
    pools = ", ".join(s.name for s in states)
    if config.kv_offload is not None:
        raise ConfigError(
            f"{config.model}: {model_config.architecture} keeps per-request recurrent state "
            f"({pools}) in state slots, and KV offload moves only KV blocks: a request loading "
            "its prefix from the store would start without the state of those tokens. "
            f"kv_offload={config.kv_offload!r} is refused for this model; run it without "
            "kv_offload"
        )
    if config.enable_prefix_caching:
        log.info(
            "prefix caching is off for %s: its recurrent state (%s) is not checkpointed at "
            "block boundaries, so a prefix hit would skip tokens the state needs",
            model_config.architecture,
            pools,
        )
    return False


def _async_scheduling(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether steps overlap (async scheduling). None decides: on (ASYNC_BY_DEFAULT) unless
    something below refuses it; True with such a thing is refused by name."""
    refusal = None
    if model_config.runner_type == "pooling":
        refusal = (
            f"{model_config.architecture} is served as a pooling model: a pooling request is "
            "one prefill step that samples nothing, so no step's tokens feed the next"
        )
    elif config.kv_offload is not None:
        refusal = (
            "kv_offload's store and load jobs read and write the KV cache between steps, "
            "which async scheduling leaves on the device"
        )
    if config.async_scheduling is None:
        return refusal is None and ASYNC_BY_DEFAULT
    if config.async_scheduling and refusal is not None:
        raise ConfigError(
            f"async_scheduling=True is not supported here: {refusal}; run with "
            "async_scheduling=False"
        )
    return config.async_scheduling
