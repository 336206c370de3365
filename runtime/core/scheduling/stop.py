"""Stop conditions applied by the scheduler after a token is appended (vLLM's check_stop).

Stop strings are the output processor's business (runtime/output_processor.py finishes those
requests through `finish_requests`).
"""

from dataclasses import dataclass

from runtime.core.request import FinishReason, Request, RequestStatus

__all__ = ["POOLED", "Stop", "check_stop"]


@dataclass(frozen=True, slots=True)
class Stop:
    status: RequestStatus
    reason: FinishReason
    # The stop token id that ended the request, else None.
    stop_reason: int | None = None


_LENGTH = Stop(RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH)
_EOS = Stop(RequestStatus.FINISHED_STOPPED, FinishReason.STOP)
# How a pooling request ends: in the step that pooled its prompt (vLLM: finish reason "stop").
POOLED = Stop(RequestStatus.FINISHED_STOPPED, FinishReason.STOP)


def check_stop(request: Request, max_model_len: int) -> Stop | None:
    """Whether `request`, whose last output token was just appended, is done.

    EOS ids (unless ignore_eos) and stop_token_ids count only once min_tokens outputs exist and
    win over the length limits on the same token, as in vLLM; max_model_len caps even before
    min_tokens, since no further position exists. The first EOS id stops with no stop_reason;
    the others report their id, as vLLM's generation-config EOS ids (stop ids there) do.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        eos = request.eos_token_ids
        if eos and not params.ignore_eos and last in eos:
            return _EOS if last == eos[0] else Stop(_EOS.status, _EOS.reason, stop_reason=last)
        if last in params.stop_token_ids:
            return Stop(RequestStatus.FINISHED_STOPPED, FinishReason.STOP, stop_reason=last)
    if request.num_tokens >= max_model_len:
        return _LENGTH
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return _LENGTH
    return None
