"""The soak's seeded workload, and its fault-free reference tokens.

Requests share a few long prefixes (so the store serves loads) and differ in suffix length,
max_tokens, priority, stop strings and stop tokens, and sampling: greedy, seeded (batch-invariant
by design, so checked like greedy) and unseeded (checked only for ending properly). Some reuse the
id of a request that already ended (the request-id ABA of vLLM #51637).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.core.request import SamplingParams

# Common in the default model's corpus, so random generations meet them now and then.
STOP_STRINGS = ("e", "th", "in", " a")


@dataclass(frozen=True)
class SoakSize:
    num_requests: int
    max_prompt: int  # tokens, shared prefix included
    max_tokens: int
    num_prefixes: int = 6
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    block_size: int = 8
    max_model_len: int = 128
    # Usable blocks: two or three requests' worth, so decode preempts often.
    num_kv_blocks: int = 36
    store_blocks: int = 192  # host store slots: fewer than the run stores, so it evicts
    # Resident memory after the run against after the warm-up. None where the run is too short
    # to tell a leak from the programs it compiles: each batch shape first met mid-run loads a
    # program of ~25-30 MiB resident (measured on the default model), and the CI size's 80
    # requests meet two to six of them, 5-17% of its ~1 GiB, nothing else in the process. Its
    # leaks are caught by count instead (blocks, pins, KV jobs, request slots left held).
    rss_growth_limit: float | None = 0.10
    # Requests (another seed's) the engine serves before the measured run. Where the RSS bound
    # applies, a whole workload: 24 requests compile a fraction of the shapes 2,000 meet (47
    # compilations mid-run, +1,300 MiB, measured), a second workload of the same size two at most.
    warmup_requests: int = 24


SIZES = {
    # The CI size: a minute on 2 cores, compilation included.
    # Two token buckets instead of three: compilation is most of its time.
    "ci": SoakSize(
        num_requests=80,
        max_prompt=64,
        max_tokens=48,
        max_num_batched_tokens=32,
        rss_growth_limit=None,
    ),
    "full": SoakSize(num_requests=2000, max_prompt=80, max_tokens=48, warmup_requests=2000),
}


@dataclass(frozen=True)
class SoakRequest:
    index: int  # position in the workload: the identity checks are keyed by
    request_id: str  # may repeat an earlier request's id (added only after that one ended)
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int

    @property
    def checked(self) -> bool:
        """Its tokens are a function of the prompt alone: greedy, or seeded sampling."""
        return self.params.temperature == 0 or self.params.seed is not None


def make_workload(size: SoakSize, vocab_size: int, seed: int) -> list[SoakRequest]:
    rng = np.random.default_rng(seed)
    prefix_len = size.max_prompt // 2
    prefixes = [rng.integers(3, vocab_size, prefix_len).tolist() for _ in range(size.num_prefixes)]
    out = []
    for index in range(size.num_requests):
        length = int(rng.integers(1, size.max_prompt + 1))
        # Most share a prefix (cut to the prompt's length).
        shared = rng.random() < 0.7
        head = prefixes[int(rng.integers(size.num_prefixes))][:length] if shared else []
        prompt = head + rng.integers(3, vocab_size, length - len(head)).tolist()
        kind = rng.random()
        common = dict(
            max_tokens=int(rng.integers(1, size.max_tokens + 1)),
            ignore_eos=bool(rng.random() < 0.5),
        )
        stops = rng.random()
        if stops < 0.1:  # found by the detokenizer, which then finishes the request
            common["stop"] = (STOP_STRINGS[int(rng.integers(len(STOP_STRINGS)))],)
        elif stops < 0.2:
            common["stop_token_ids"] = (int(rng.integers(3, vocab_size)),)
        if kind < 0.6:
            params = SamplingParams(temperature=0.0, **common)
        elif kind < 0.8:
            params = SamplingParams(
                temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 31)), **common
            )
        else:
            params = SamplingParams(temperature=1.0, **common)
        # One in ten reuses the id of a request a few places back (added once that one ended).
        reuse = index >= 8 and rng.random() < 0.1
        request_id = out[index - int(rng.integers(1, 8))].request_id if reuse else f"r{index}"
        out.append(
            SoakRequest(index, request_id, tuple(prompt), params, priority=int(rng.integers(0, 4)))
        )
    return out


def reference_tokens(engine, workload: list[SoakRequest]) -> dict[int, list[int]]:
    """Each checked request's tokens from a fault-free engine: no store, no aborts, unique ids.

    The unchecked requests run too: they bring the same sampling variants (each one compiled
    step), so the soak's engine finds them compiled and its warm-up measures memory, not XLA."""
    for req in workload:
        engine.add_request(
            f"ref{req.index}", list(req.prompt_token_ids), req.params, priority=req.priority
        )
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = int(output.request_id[3:])
            if workload[index].checked:
                tokens[index] = list(output.outputs[0].token_ids)
    return tokens
