"""What `LLM.generate` returns, in vLLM's shapes (defined in runtime/request_output.py)."""

from runtime.request_output import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

__all__ = ["CompletionOutput", "Logprob", "PositionLogprobs", "RequestOutput"]
