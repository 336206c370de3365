"""What `ModelRunner.execute` raises, so that the engine knows what it may do next.

- `RequestFailed`: the step could not run because of the named requests. The runner is as it was
  before the call (mirror undone, device untouched): the engine finishes those requests with an
  error and goes on with the others.
- any other exception raised before the device step: the same guarantee, but nobody is named;
  the engine keeps its state and the caller gets the exception.
- `RunnerLost`: the device step failed after it took the KV cache (it is donated), so what the
  cache holds is unknown; the engine cannot go on (vLLM's EngineDeadError).
"""

from __future__ import annotations

from collections.abc import Iterable


class RequestFailed(ValueError):
    def __init__(self, request_ids: Iterable[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = tuple(request_ids)


class RunnerLost(RuntimeError):
    """The device step failed after it took the KV cache; the runner cannot serve any more."""
