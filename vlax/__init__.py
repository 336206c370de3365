"""vlax: a pure-functional LLM inference engine core in JAX and Pallas."""

from vlax import logs

logs.configure()

from runtime.core.request import SamplingParams  # noqa: E402
from vlax.llm import LLM  # noqa: E402
from vlax.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
