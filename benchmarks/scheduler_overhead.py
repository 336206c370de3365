"""Host cost of one scheduler step (schedule + update) on synthetic workloads, no model.

Prefix caching and chunked prefill on; every request arrives at step 0 with random prompt
tokens (seeded); the runner's sampled tokens come from `runtime.core.devtools.synthetic_runner`, built
outside the timed region. Step times are this thread's CPU time (the machine is shared; wall
time also counts other processes' turns on the cores). Each case runs `--repeats` times (other
load only ever adds time); the figures are those of the run with the lowest mean, and
`mean_step_ms_runs` lists every run's mean. Cases:
- small: 100 requests, prompts 10-600 tokens, max_tokens 10-100, 1024 blocks of 16 tokens,
  max_num_seqs 64, max_num_batched_tokens 512;
- large: 1000 requests (same ranges), 16384 blocks of 16 tokens, max_num_seqs 256,
  max_num_batched_tokens 8192.

    python3 benchmarks/scheduler_overhead.py --json
"""

import argparse
import gc
import json
import random
import statistics
import time

from runtime.core import scheduler as sch
from runtime.core.devtools.synthetic_runner import runner_output
from runtime.core.request import Request, SamplingParams

CASES = {
    "small": {"requests": 100, "num_blocks": 1024, "max_num_seqs": 64, "max_tokens": 512},
    "large": {"requests": 1000, "num_blocks": 16384, "max_num_seqs": 256, "max_tokens": 8192},
}
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


def make_requests(num_requests: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        prompt = tuple(rng.randrange(3, 32000) for _ in range(rng.randint(10, 600)))
        params = SamplingParams(max_tokens=rng.randint(10, 100), ignore_eos=True)
        requests.append(Request(f"req-{index}", prompt, params, arrival_time=float(index)))
    return requests


def run_case(name: str, seed: int, repeats: int = 1) -> dict:
    runs = [_run_once(name, seed) for _ in range(repeats)]
    best = min(runs, key=lambda row: row["mean_step_ms"])
    return {**best, "mean_step_ms_runs": [row["mean_step_ms"] for row in runs]}


def _run_once(name: str, seed: int) -> dict:
    case = CASES[name]
    config = sch.SchedulerConfig(
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_tokens"],
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_blocks=case["num_blocks"],
    )
    state = sch.make_scheduler(config)
    for request in make_requests(case["requests"], seed):
        state = sch.add_request(state, request)
    step_ms, preemptions = [], 0
    gc.collect()
    while sch.has_unfinished_requests(state):
        start = time.thread_time()
        scheduled, out = sch.schedule(state)
        middle = time.thread_time()
        mro = runner_output(scheduled, out)
        resume = time.thread_time()
        state, _ = sch.update(scheduled, out, mro)
        end = time.thread_time()
        step_ms.append((middle - start + end - resume) * 1e3)
        preemptions += len(out.preempted_req_ids)
    return {
        "case": name,
        "num_blocks": case["num_blocks"],
        "block_size": BLOCK_SIZE,
        "mean_step_ms": round(statistics.fmean(step_ms), 4),
        "median_step_ms": round(statistics.median(step_ms), 4),
        "steps": len(step_ms),
        "preemptions": preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    results = {name: run_case(name, args.seed, args.repeats) for name in args.cases}
    if args.json:
        print(json.dumps(results))
    else:
        for row in results.values():
            print(
                f"{row['case']:>6}: mean {row['mean_step_ms']:.3f} ms, median "
                f"{row['median_step_ms']:.3f} ms over {row['steps']} steps, "
                f"{row['preemptions']} preemptions ({row['num_blocks']} blocks of {BLOCK_SIZE})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
