"""Step messages between the scheduler, the model runner and the engine (vLLM V1 semantics).

`SchedulerOutput` is what one step asks the runner to compute; `ModelRunnerOutput` is what the
runner reports back; `EngineCoreOutput` is what `update` hands the engine per request.
Ordered per-request maps are read-only `MappingProxyType`s over insertion-ordered dicts, because
the batch order of requests is part of the message (`immutables.Map` iterates in hash order).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from immutables import Map

from runtime.core.request import FinishReason, MultiModalInput, PoolingParams, SamplingParams

__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "CachedRequestData",
    "EngineCoreOutput",
    "LogprobsEntry",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
    "frozen_mapping",
]

EMPTY_MAPPING: Mapping = MappingProxyType({})


def frozen_mapping(items: dict) -> Mapping:
    """A read-only, insertion-ordered view of `items` (the caller gives up the dict)."""
    return MappingProxyType(items) if items else EMPTY_MAPPING


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen (in this lifecycle): everything it needs to start it."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    mm_inputs: tuple[MultiModalInput, ...]
    sampling_params: SamplingParams
    # The whole block table, prefix-cache hits first.
    block_ids: tuple[int, ...]
    # Tokens already in the KV cache (the prefix-cache hit); computing starts here.
    num_computed_tokens: int
    lora_name: str | None = None
    # The request's EOS ids (Request.eos_token_ids): the sampler's min_tokens mask holds them back.
    eos_token_ids: tuple[int, ...] = ()
    # A pooling request's parameters (resolved for its task); None for a generate request.
    pooling_params: PoolingParams | None = None


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A delta for a request the runner already knows.

    When `resumed_from_preemption`, `new_block_ids` REPLACES the runner's block table and
    `all_token_ids` carries every token the request has; otherwise the ids are appended and
    `all_token_ids` is None.
    """

    req_id: str
    resumed_from_preemption: bool
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    all_token_ids: tuple[int, ...] | None
    num_output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan. Batch order: `scheduled_cached_reqs`, then `scheduled_new_reqs`;
    `num_scheduled_tokens` and `scheduled_encoder_inputs` iterate in that order."""

    step: int
    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    # req id -> indices into its mm_inputs whose encoder outputs are computed this step.
    scheduled_encoder_inputs: Mapping[str, tuple[int, ...]]
    # Encoder outputs the runner may delete (none of them is cached in the final state).
    free_encoder_hashes: tuple[str, ...]
    preempted_req_ids: tuple[str, ...]
    # Finished or aborted since the previous step; the runner drops their state first.
    finished_req_ids: tuple[str, ...]
    # KV store/load jobs planned this step (runtime/core/kv_jobs/jobs.py), for the offload worker.
    kv_jobs: tuple = ()
    # Hybrid models (SchedulerConfig.num_state_slots > 0): req id -> its recurrent-state slot,
    # for every request scheduled this step, in batch order; empty otherwise.
    state_slots: Mapping[str, int] = field(default_factory=lambda: EMPTY_MAPPING)
    # Sorted slots whose new owner starts this step (admitted, or re-admitted after preemption
    # and recomputing from token 0): the runner marks their rows `state_reset` and the model
    # reads zeros for them, so no request ever starts from the state a previous owner left.
    reset_state_slots: tuple[int, ...] = ()

    @property
    def req_ids(self) -> tuple[str, ...]:
        """Scheduled request ids in batch order."""
        return tuple(self.num_scheduled_tokens)


@dataclass(frozen=True, slots=True)
class LogprobsEntry:
    """Logprobs of consecutive positions of one request, one row per position.

    Each row holds the top-N token ids and their logprobs, plus the sampled token when it is not
    among them; `sampled_token_ranks[i]` is the sampled token's rank at position i.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    sampled_token_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        rows = len(self.token_ids)
        if len(self.logprobs) != rows or len(self.sampled_token_ranks) != rows:
            raise ValueError(
                f"LogprobsEntry: {rows} token id rows, {len(self.logprobs)} logprob rows and "
                f"{len(self.sampled_token_ranks)} ranks; expected one of each per position"
            )
        for ids, lps in zip(self.token_ids, self.logprobs, strict=True):
            if len(ids) != len(lps):
                raise ValueError(
                    f"LogprobsEntry: a row has {len(ids)} token ids but {len(lps)} logprobs"
                )

    def head(self, n: int) -> "LogprobsEntry":
        """The first `n` positions (a request that stopped mid-way keeps only those)."""
        if n >= len(self.token_ids):
            return self
        return LogprobsEntry(self.token_ids[:n], self.logprobs[:n], self.sampled_token_ranks[:n])


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What the runner computed for one step: per request (in `req_ids` order) the sampled tokens;
    a request still in prefill (a partial chunk) gets `()`."""

    req_ids: tuple[str, ...]
    sampled_token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[LogprobsEntry | None, ...] | None = None
    # req id -> logprobs of its prompt positions, given once its prefill completes.
    prompt_logprobs: Map | None = None
    # Pooling requests: per request (in `req_ids` order) its pooled output once its last prompt
    # token is computed (an array the core passes on without reading), else None. None: no
    # pooling request in the step.
    pooler_output: tuple[object | None, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.sampled_token_ids):
            raise ValueError(
                f"ModelRunnerOutput: {len(self.req_ids)} req_ids but "
                f"{len(self.sampled_token_ids)} sampled_token_ids rows; expected one per request"
            )
        if len(set(self.req_ids)) != len(self.req_ids):
            raise ValueError(f"ModelRunnerOutput: repeated req_ids {self.req_ids}")
        if self.logprobs is not None and len(self.logprobs) != len(self.req_ids):
            raise ValueError(
                f"ModelRunnerOutput: {len(self.logprobs)} logprobs entries for "
                f"{len(self.req_ids)} requests; expected one (or None) per request"
            )
        if self.pooler_output is not None and len(self.pooler_output) != len(self.req_ids):
            raise ValueError(
                f"ModelRunnerOutput: {len(self.pooler_output)} pooler_output entries for "
                f"{len(self.req_ids)} requests; expected one (or None) per request"
            )


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=(), sampled_token_ids=())


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step did for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request (or a stop string, set by the engine).
    stop_reason: int | str | None = None
    new_logprobs: LogprobsEntry | None = None
    new_prompt_logprobs: LogprobsEntry | None = None
    # A pooling request's output (the runner's pooler_output entry), in the step it finished.
    pooling_output: object | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
