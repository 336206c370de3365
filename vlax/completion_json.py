"""One completion as a JSON object: the layout `vlax generate --output` and `vlax batch` write."""

from __future__ import annotations


def completion_json(c) -> dict:
    """A CompletionOutput's fields, its logprobs as one list per position of
    {token_id, logprob, rank, token} (None without logprobs)."""
    logprobs = None
    if c.logprobs is not None:
        logprobs = [
            [
                {"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                for t, lp in position.items()
            ]
            for position in c.logprobs
        ]
    return {
        "index": c.index,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "cumulative_logprob": c.cumulative_logprob,
        "logprobs": logprobs,
    }
