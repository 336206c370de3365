"""Steps in flight under async scheduling (vLLM's AsyncScheduler), per request.

With `SchedulerConfig.async_scheduling`, schedule() may plan step N+1 before update() has applied
step N. A request's entries name the steps scheduled for it and not yet applied, oldest first:

    (step, num_tokens, samples, stale)

`samples`: the step computes the request's last known token, so the runner samples one token
whose value the core learns only at update (vLLM's output placeholder). `stale`: the request was
preempted after the step was planned; the step's token is still delivered (appended, stop
checks) but its computed tokens no longer count, since the request recomputes from token 0
(vLLM's num_stale_output_tokens).

Planning sees a request as if its in-flight steps had been applied: computed tokens plus the
tokens in flight, known tokens plus one placeholder per sampling step (vLLM advances
num_computed_tokens in schedule() and counts num_output_placeholders).
"""

__all__ = ["InFlight", "ahead", "mark_stale"]

# (step, num_tokens, samples, stale)
InFlight = tuple[int, int, bool, bool]


def ahead(entries: tuple[InFlight, ...]) -> tuple[int, int]:
    """(tokens in flight, placeholders) over the entries that still count."""
    tokens = placeholders = 0
    for _, num_tokens, samples, stale in entries:
        if not stale:
            tokens += num_tokens
            placeholders += samples
    return tokens, placeholders


def mark_stale(entries: tuple[InFlight, ...]) -> tuple[InFlight, ...]:
    return tuple((step, num_tokens, samples, True) for step, num_tokens, samples, _ in entries)
