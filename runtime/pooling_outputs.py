"""What a pooling request returns, in vLLM's shapes (`vlax.outputs` re-exports them).

`PoolingRequestOutput.outputs.data` is the raw pooled array (numpy float32: [hidden] for a
sequence embedding, [labels] for classification probabilities, [tokens, hidden] for `encode`);
`LLM.embed`, `classify` and `score` give the typed views vLLM gives: `outputs.embedding`
(list of floats), `outputs.probs` (list of floats), `outputs.score` (a float).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Self

import numpy as np


@dataclass
class PoolingOutput:
    data: np.ndarray


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    # "stop" once pooled; "abort" or "error" when it was not (then `outputs` is None).
    finish_reason: str | None = None
    # With finish_reason "error": what went wrong serving this request.
    error: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class _TypedRequestOutput:
    """A pooled request's typed view (vLLM's PoolingRequestOutput[T] subclasses): the same fields
    for every task; `outputs` is the task's output type, built from the 1-d pooled array."""

    request_id: str
    outputs: EmbeddingOutput | ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    output_type: ClassVar[type[EmbeddingOutput] | type[ClassificationOutput]]

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> Self:
        data = _data(out, ndim=1)
        return cls(out.request_id, cls.output_type(data.tolist()), out.prompt_token_ids)


@dataclass
class EmbeddingRequestOutput(_TypedRequestOutput):
    outputs: EmbeddingOutput
    output_type: ClassVar[type[EmbeddingOutput]] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TypedRequestOutput):
    outputs: ClassificationOutput
    output_type: ClassVar[type[ClassificationOutput]] = ClassificationOutput


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    # The pair's tokens (a cross-encoder's one prompt; for an embedding model, the two prompts'
    # tokens joined, as vLLM reports them).
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True


def _data(out: PoolingRequestOutput, ndim: int) -> np.ndarray:
    if out.outputs is None:
        raise RuntimeError(
            f"request {out.request_id!r} finished with {out.finish_reason!r} and no output"
            + (f": {out.error}" if out.error else "")
        )
    data = out.outputs.data
    if data.ndim != ndim:
        raise ValueError(
            f"request {out.request_id!r}: expected a {ndim}-d pooled output, got shape {data.shape}"
        )
    return data
