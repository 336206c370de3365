"""SchedulerConfig: the limits one scheduler works within, validated with errors naming the knob."""

from dataclasses import dataclass

__all__ = ["POLICIES", "SchedulerConfig", "SchedulerConfigError"]

POLICIES = ("fcfs", "priority")


class SchedulerConfigError(ValueError):
    """A SchedulerConfig field is out of range or inconsistent with another."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # A prefill chunk of one request is at most this many tokens (0 = no cap).
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # Admit a waiting request only if all its tokens fit in the free blocks, not just its first
    # chunk (vLLM's scheduler_reserve_full_isl, on by default there too).
    reserve_full_sequence: bool = True
    # In encoder embeddings; None = max_num_batched_tokens (vLLM's default).
    encoder_cache_size: int | None = None
    encoder_compute_budget: int | None = None
    # Recurrent-state slots of a hybrid model (runtime/core/state/state_slots.py): 0 = the model
    # keeps no per-request state; n > 0: slots 0..n-1, one held by each running request, so at
    # most n requests run at once.
    num_state_slots: int = 0
    # vLLM's async scheduling (AsyncScheduler): step N+1 may be planned while step N is still
    # being computed, its sampled tokens counted as placeholders (runtime/core/scheduling/
    # in_flight.py); at most one step is in flight when the next is planned.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_model_len", 2),
            ("block_size", 1),
            ("num_blocks", 2),
            ("long_prefill_token_threshold", 0),
            ("num_state_slots", 0),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                raise SchedulerConfigError(
                    f"SchedulerConfig.{name}={value!r}: expected an int >= {minimum}"
                )
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "reserve_full_sequence",
            "async_scheduling",
        ):
            if not isinstance(getattr(self, name), bool):
                raise SchedulerConfigError(
                    f"SchedulerConfig.{name}={getattr(self, name)!r}: expected a bool"
                )
        if self.policy not in POLICIES:
            raise SchedulerConfigError(
                f"SchedulerConfig.policy={self.policy!r}: expected one of {POLICIES}"
            )
        for name in ("encoder_cache_size", "encoder_compute_budget"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, self.max_num_batched_tokens)
            elif not _is_int(value) or value < 0:
                raise SchedulerConfigError(
                    f"SchedulerConfig.{name}={value!r}: expected an int >= 0 (embeddings) or None"
                )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerConfigError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}: every running sequence needs a token per step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise SchedulerConfigError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_model_len={self.max_model_len} with chunked prefill off: a longer prompt "
                "could never be scheduled; raise max_num_batched_tokens or enable chunked prefill"
            )
        if self.num_state_slots and self.enable_prefix_caching:
            raise SchedulerConfigError(
                f"SchedulerConfig.enable_prefix_caching=True with num_state_slots="
                f"{self.num_state_slots}: a prefix hit would skip the tokens a request's recurrent "
                "state is built from, and hybrid prefix caching (state checkpoints per block) is "
                "not built; set enable_prefix_caching=False for a model with state slots"
            )
        usable = (self.num_blocks - 1) * self.block_size
        if usable < self.max_model_len:
            raise SchedulerConfigError(
                f"SchedulerConfig.num_blocks={self.num_blocks}: {self.num_blocks - 1} usable "
                f"blocks of {self.block_size} tokens hold {usable} tokens, fewer than "
                f"max_model_len={self.max_model_len}; one request could never finish"
            )
