"""vlax: a pure-functional LLM inference engine core in JAX and Pallas."""

from runtime.core.request import SamplingParams
from vlax.llm import LLM
from vlax.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
