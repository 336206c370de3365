"""EngineConfig: every engine knob in one validated value, with errors that name the bad setting."""

from __future__ import annotations

from dataclasses import dataclass

from model.config import DTYPES, ConfigError
from runtime.offload.store import KVStore, check_store

# The accepted values, shared with the CLI's choices.
DTYPE_CHOICES = ("auto", *DTYPES)  # vLLM's choice from the checkpoint (model/config.py), or a cast
ATTENTION_BACKENDS = ("auto", "pallas", "reference")
_OFFLOAD = (None, "host", "mooncake")
RUNNERS = ("auto", "generate", "pooling")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    # vLLM's runner: "auto" decides from the checkpoint's configuration (model/routing.py);
    # "pooling" serves a generative checkpoint as an embedder, "generate" a pooling one's LM.
    runner: str = "auto"
    max_model_len: int | None = None
    # None: vLLM 0.33's defaults for an offline LLM on this platform (runtime/engine_setup.py).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    # vLLM's max_logprobs: the most top logprobs (sample or prompt) a request may ask for; -1:
    # the whole vocabulary.
    max_logprobs: int = 20
    attention_backend: str = "auto"
    # "host", "mooncake", or a store object implementing runtime/offload/store.py's KVStore.
    kv_offload: str | KVStore | None = None
    kv_offload_bytes: int = 256 << 20
    mooncake_master: str | None = None
    # Scale-out, under vLLM's names: one engine over tensor_parallel_size devices (on a
    # multi-host group, its processes' devices together), with the experts split over them
    # instead of their intermediate under enable_expert_parallel. Data-parallel replicas are
    # separate engines: vlax.batch runs them on Ray, so one engine takes only 1.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    # Multimodal models: the encoder cache and the encoder embeddings computed per step, both in
    # encoder embeddings (vLLM's encoder_cache_size / encoder_compute_budget); None:
    # max_num_batched_tokens, vLLM's default.
    encoder_cache_size: int | None = None
    encoder_compute_budget: int | None = None
    # vLLM's async scheduling: step N+1 is scheduled and dispatched while step N runs on the
    # device (runtime/engine.py). None: the engine's default (runtime/engine_setup.py
    # ASYNC_BY_DEFAULT), off for pooling models and with kv_offload; True where those refuse it
    # is an error.
    async_scheduling: bool | None = None
    # glibc malloc keeps freed host buffers mapped, so XLA:CPU's per-step buffers are not
    # faulted in again every step (runtime/host_malloc.py); a process-wide setting.
    keep_host_buffers: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.runner not in RUNNERS:
            raise ConfigError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.max_num_seqs is not None:
            _positive("max_num_seqs", self.max_num_seqs)
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < -1
        ):
            raise ConfigError(
                f"max_logprobs must be an int >= 0, or -1 (the whole vocabulary), "
                f"got {self.max_logprobs!r}"
            )
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks < 2:
                raise ConfigError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        if self.kv_cache_bytes is not None:
            _positive("kv_cache_bytes", self.kv_cache_bytes)
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ConfigError("give num_kv_blocks or kv_cache_bytes, not both")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if isinstance(self.kv_offload, str) or self.kv_offload is None:
            if self.kv_offload not in _OFFLOAD:
                raise ConfigError(
                    f"kv_offload must be one of {_OFFLOAD} or a KV store object, "
                    f"got {self.kv_offload!r}"
                )
        else:
            try:
                check_store(self.kv_offload)
            except TypeError as err:
                raise ConfigError(str(err)) from None
        if self.kv_offload == "mooncake" and not self.mooncake_master:
            raise ConfigError("kv_offload='mooncake' needs mooncake_master='HOST:PORT'")
        _positive("kv_offload_bytes", self.kv_offload_bytes)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(
                f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}"
            )
        _positive("data_parallel_size", self.data_parallel_size)
        if not isinstance(self.keep_host_buffers, bool):
            raise ConfigError(
                f"keep_host_buffers must be True or False, got {self.keep_host_buffers!r}"
            )
        if self.async_scheduling not in (None, True, False):
            raise ConfigError(
                f"async_scheduling must be True, False or None (the engine's default), "
                f"got {self.async_scheduling!r}"
            )
        for name in ("encoder_cache_size", "encoder_compute_budget"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.data_parallel_size != 1:
            raise ConfigError(
                f"data_parallel_size={self.data_parallel_size}: one LLM is one engine; run "
                "data-parallel replicas with vlax.batch (Ray Data, one LLM per actor), each of "
                "them tensor_parallel_size devices"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
