"""What `LLM` returns, in vLLM's shapes (defined in runtime/request_output.py and, for pooling
models, runtime/pooling_outputs.py)."""

from runtime.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from runtime.request_output import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "PositionLogprobs",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
