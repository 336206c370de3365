"""The workloads of benchmarks/vllm_scheduler_diff.py: each case's settings and its seeded requests,
arrivals and abort steps, the same for vLLM's scheduler and vlax's.

Workloads (`--cases`; each runs once per seed of `--seeds`):
- small, large: the scheduler_overhead workloads (every request at step 0);
- tight: a pool small enough to preempt often;
- priority: priority policy, random priorities, arrivals over time, tight pool;
- prefix, prefix_off, prefix_priority: prompts sharing a few long prefixes, arrivals over time,
  a tight pool (prefix caching on; off; on with the priority policy);
- prompt_logprobs: as prefix, with 30% of the requests asking for prompt logprobs (they read no
  prefix-cache hit, as in vLLM, but still cache their blocks);
- aborts, aborts_priority: aborts at seeded steps of running, waiting and preempted requests,
  applied to both between update() and the next schedule();
- max_model_len: max_tokens far past a small max_model_len, so most requests hit the cap;
- no_chunking: chunked prefill off (a prompt waits until it fits the step's budget whole);
- long_prefill: long_prefill_token_threshold caps each prefill chunk;
- finish_order: a scripted priority case where a new and a resumed request, admitted in that
  order, finish in the same step (their order of freeing blocks shows in the free queue);
- short_outputs: half the requests want 1-3 output tokens, under the priority policy, so new and
  resumed requests admitted in one step may finish in it (the order they free blocks in matters).
"""

import random

from benchmarks.scheduler_overhead import BLOCK_SIZE, CASES, MAX_MODEL_LEN
from runtime.core.request import Request, SamplingParams

TIGHT = {"requests": 100, "num_blocks": 256, "max_num_seqs": 64, "max_tokens": 512}
SHARED = {"requests": 120, "num_blocks": 160, "max_num_seqs": 32, "max_tokens": 256}
WORKLOADS = {
    **{name: {**case} for name, case in CASES.items()},
    "tight": TIGHT,
    "priority": {**TIGHT, "policy": "priority", "arrivals": 300},
    "prefix": {**SHARED, "prompts": "shared", "arrivals": 400},
    "prefix_off": {**SHARED, "prompts": "shared", "arrivals": 400, "prefix_caching": False},
    "prefix_priority": {**SHARED, "prompts": "shared", "arrivals": 400, "policy": "priority"},
    "prompt_logprobs": {**SHARED, "prompts": "shared", "arrivals": 400, "prompt_logprobs": 0.3},
    "aborts": {**SHARED, "prompts": "shared", "arrivals": 300, "abort_rate": 0.08},
    "aborts_priority": {
        **SHARED,
        "prompts": "shared",
        "arrivals": 300,
        "abort_rate": 0.08,
        "policy": "priority",
    },
    "max_model_len": {**TIGHT, "max_model_len": 320, "outputs": [(100, 400)], "arrivals": 200},
    "no_chunking": {
        **TIGHT,
        "max_model_len": 640,
        "max_tokens": 640,
        "chunked_prefill": False,
        "arrivals": 200,
    },
    "long_prefill": {**TIGHT, "long_prefill": 64, "arrivals": 200},
    "finish_order": {
        "requests": 4,
        "num_blocks": 7,
        "max_num_seqs": 8,
        "max_tokens": 256,
        "max_model_len": 96,
        "policy": "priority",
        "prompts": "finish_order",
    },
    "short_outputs": {
        **SHARED,
        "prompts": "shared",
        "arrivals": 200,
        "outputs": [(1, 3), (30, 200)],
        "policy": "priority",
        "num_blocks": 96,
        "max_model_len": 1024,
    },
}


def make_workload(case: dict, seed: int) -> tuple[list[tuple[int, Request]], list[int]]:
    """(arrival step, request) pairs in arrival order, and the steps at which an abort is due."""
    rng = random.Random(seed)
    if case.get("prompts") == "finish_order":
        return finish_order_workload(rng), []
    max_model_len = case.get("max_model_len", MAX_MODEL_LEN)
    longest = min(600, max_model_len - 1)
    bases = [tuple(rng.randrange(3, 32000) for _ in range(400)) for _ in range(4)]
    # max_tokens drawn from one of these ranges, picked per request.
    outputs = case.get("outputs", [(10, 100)])
    arrivals = sorted(rng.randrange(case.get("arrivals", 1)) for _ in range(case["requests"]))
    workload = []
    for index, step in enumerate(arrivals):
        if case.get("prompts") == "shared":
            shared = rng.choice(bases)[: rng.randint(0, 300)]
            own = tuple(rng.randrange(3, 32000) for _ in range(rng.randint(1, 120)))
            prompt = (shared + own)[:longest]
        else:
            prompt = tuple(rng.randrange(3, 32000) for _ in range(rng.randint(10, longest)))
        # A request asking for prompt logprobs reads no prefix-cache hit (it still caches).
        prompt_logprobs = 1 if rng.random() < case.get("prompt_logprobs", 0.0) else None
        request = Request(
            f"req-{index}",
            prompt,
            SamplingParams(
                max_tokens=rng.randint(*rng.choice(outputs)),
                ignore_eos=True,
                prompt_logprobs=prompt_logprobs,
            ),
            arrival_time=float(index),
            priority=rng.randint(0, 3) if case.get("policy") == "priority" else 0,
        )
        workload.append((step, request))
    rate = case.get("abort_rate", 0.0)
    aborts = [step for step in range(100_000) if rate and rng.random() < rate]
    return workload, aborts


def finish_order_workload(rng: random.Random) -> list[tuple[int, Request]]:
    """p (least urgent) is preempted at step 2 for h; n, more urgent, arrives at step 3 and is
    admitted before p, and both finish in that step: vLLM frees n's blocks, then p's."""

    def make(name, length, max_tokens, priority, arrival):
        start = rng.randrange(3, 30000)
        return Request(
            name,
            tuple(range(start, start + length)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            arrival_time=arrival,
            priority=priority,
        )

    size = BLOCK_SIZE
    return [
        (0, make("p", size + size // 4, 3, 1, 0.0)),
        (0, make("h", 2 * size - 1, 40, 0, 1.0)),
        (0, make("f", 2 * size - 2, 3, 0, 2.0)),
        (3, make("n", size // 4, 1, 0, 3.0)),
    ]
