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

`--async`: async scheduling (schedule step N+1, then update step N), the runner's tokens from a
device-like synthetic runner (runtime/core/devtools/device_rows.py), outside the timed region.
`--vllm`: the same trace through vLLM 0.33's mutable Scheduler (AsyncScheduler with --async),
schedule() + update_from_output() timed the same way, and the ratio vlax / vLLM per case; run it
from the venv benchmarks/vllm_scheduler_diff.py describes (vLLM is not a project dependency).
The two sides run interleaved (vlax, vLLM, vlax, ...) so load drifts hit both alike.

    python3 benchmarks/scheduler_overhead.py --json
    /tmp/vllmenv/bin/python benchmarks/scheduler_overhead.py --vllm [--async] --json
"""

import argparse
import gc
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from runtime.core import scheduler as sch  # noqa: E402
from runtime.core.devtools.device_rows import DeviceRows  # noqa: E402
from runtime.core.devtools.synthetic_runner import runner_output  # noqa: E402
from runtime.core.request import Request, SamplingParams  # noqa: E402

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


def run_case(
    name: str, seed: int, repeats: int = 1, async_mode: bool = False, model_dir: str | None = None
) -> dict:
    """vlax's figures; with `model_dir` (a folder for vLLM's config), vLLM's too, interleaved."""
    runs, theirs = [], []
    for _ in range(repeats):
        runs.append(_run_once(name, seed, async_mode))
        if model_dir is not None:
            theirs.append(_run_vllm_once(name, seed, async_mode, model_dir))
    best = min(runs, key=lambda row: row["mean_step_ms"])
    result = {**best, "mean_step_ms_runs": [row["mean_step_ms"] for row in runs]}
    if theirs:
        their_best = min(theirs, key=lambda row: row["mean_step_ms"])
        result["vllm"] = {
            **their_best,
            "mean_step_ms_runs": [row["mean_step_ms"] for row in theirs],
        }
        result["ratio_vs_vllm"] = round(best["mean_step_ms"] / their_best["mean_step_ms"], 3)
    return result


def _device_token(prompt, tokens) -> int:
    return (len(tokens) * 7919 + len(prompt)) % 30000 + 3


def _run_once(name: str, seed: int, async_mode: bool = False) -> dict:
    case = CASES[name]
    config = sch.SchedulerConfig(
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_tokens"],
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_blocks=case["num_blocks"],
        async_scheduling=async_mode,
    )
    state = sch.make_scheduler(config)
    for request in make_requests(case["requests"], seed):
        state = sch.add_request(state, request)
    step_ms, preemptions = [], 0
    gc.collect()
    if async_mode:
        return _summary(name, *_run_async(state))
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
    return _summary(name, step_ms, preemptions)


def _run_async(state) -> tuple[list[float], int]:
    """Schedule step N+1, then update step N (one step in flight); the device-like runner runs
    each step when it is scheduled, outside the timed region."""
    device = DeviceRows(_device_token)
    step_ms, preemptions, pending = [], 0, None
    while sch.has_unfinished_requests(state) or pending:
        elapsed = 0.0
        scheduled = None
        if sch.has_unfinished_requests(state):
            start = time.thread_time()
            state, out = sch.schedule(state)
            elapsed += time.thread_time() - start
            scheduled = (out, device.execute(out))
            preemptions += len(out.preempted_req_ids)
        if pending is not None:
            start = time.thread_time()
            state, _ = sch.update(state, *pending)
            elapsed += time.thread_time() - start
        pending = scheduled
        step_ms.append(elapsed * 1e3)
    return step_ms, preemptions


def _run_vllm_once(name: str, seed: int, async_mode: bool, model_dir: str) -> dict:
    """The same trace through vLLM's scheduler (built as benchmarks/vllm_scheduler_diff.py
    builds it); the runner output is made outside the timed region."""
    from vllm.v1.outputs import ModelRunnerOutput as VllmRunnerOutput

    from benchmarks.vllm_scheduler_diff import make_vllm_scheduler, vllm_request

    scheduler = make_vllm_scheduler(CASES[name], model_dir, async_mode)
    for request in make_requests(CASES[name]["requests"], seed):
        scheduler.add_request(vllm_request(request))
    step_ms, preemptions, pending = [], 0, None
    gc.collect()
    while scheduler.has_unfinished_requests() or pending:
        elapsed = 0.0
        scheduled = None
        if scheduler.has_unfinished_requests():
            start = time.thread_time()
            out = scheduler.schedule()
            elapsed += time.thread_time() - start
            req_ids = list(out.num_scheduled_tokens)
            sampled = []
            for request_id in req_ids:
                request = scheduler.requests[request_id]
                position = request.num_computed_tokens
                done = not request.is_prefill_chunk
                sampled.append(
                    [(position * 7919 + request.num_prompt_tokens) % 30000 + 3] if done else []
                )
            runner = VllmRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
            )
            scheduled = (out, runner)
            preemptions += len(out.preempted_req_ids or ())
        if not async_mode:
            pending, scheduled = scheduled, None
        if pending is not None:
            start = time.thread_time()
            scheduler.update_from_output(*pending)
            elapsed += time.thread_time() - start
        pending = scheduled
        step_ms.append(elapsed * 1e3)
    return _summary(name, step_ms, preemptions)


def _summary(name: str, step_ms: list[float], preemptions: int) -> dict:
    case = CASES[name]
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
    parser.add_argument("--async", dest="async_mode", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="also time vLLM 0.33's scheduler")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as model_dir:
        if args.vllm:
            from benchmarks.vllm_scheduler_diff import TINY_CONFIG

            pathlib.Path(model_dir, "config.json").write_text(json.dumps(TINY_CONFIG))
        results = {
            name: run_case(
                name, args.seed, args.repeats, args.async_mode, model_dir if args.vllm else None
            )
            for name in args.cases
        }
    if args.json:
        print(json.dumps(results))
    else:
        for row in results.values():
            print(
                f"{row['case']:>6}: mean {row['mean_step_ms']:.3f} ms, median "
                f"{row['median_step_ms']:.3f} ms over {row['steps']} steps, "
                f"{row['preemptions']} preemptions ({row['num_blocks']} blocks of {BLOCK_SIZE})"
            )
            if "vllm" in row:
                theirs = row["vllm"]
                print(
                    f"{'vLLM':>6}: mean {theirs['mean_step_ms']:.3f} ms, median "
                    f"{theirs['median_step_ms']:.3f} ms over {theirs['steps']} steps; "
                    f"vlax / vLLM = {row['ratio_vs_vllm']}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
