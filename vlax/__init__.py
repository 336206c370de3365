"""vlax: a pure-functional LLM inference engine core in JAX and Pallas.

`LLM` and the output types load on first use (PEP 562), so `vlax.cli` can check its arguments
and report a bad one before JAX is imported (that import alone takes seconds).
"""

from typing import TYPE_CHECKING

from vlax import logs
from vlax.batch import batch  # light: Ray and JAX load when a job runs

logs.configure()

if TYPE_CHECKING:
    from runtime.core.request import PoolingParams, SamplingParams
    from vlax.llm import LLM
    from vlax.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "batch",
]

_HOMES = {
    "LLM": "vlax.llm",
    "CompletionOutput": "vlax.outputs",
    "Logprob": "vlax.outputs",
    "RequestOutput": "vlax.outputs",
    "SamplingParams": "runtime.core.request",
    "PoolingParams": "runtime.core.request",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'vlax' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
