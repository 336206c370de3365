"""Latency of the jitted sampler and of building its metadata on the host, per batch mix.

Mixes: all greedy; random sampling (temperature only); the full path (top-k, top-p, min-p,
penalties over 512-token prompts and 128-token outputs, logit bias, logprobs k=5). Reported
figures are milliseconds per call, medians over `--repeats` runs after one compiling call.

    python3 benchmarks/sampler.py --json
"""

import argparse
import json
import statistics
import time

import jax
import numpy as np

from runtime.core.request import SamplingParams
from runtime.runner.sampler import sample
from runtime.runner.sampling_metadata import SamplingRow, make_sampling_metadata

MIXES = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "random": (SamplingParams(temperature=0.8), None),
    "full": (
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={3: 1.0}),
        5,
    ),
}  # fmt: skip


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(num_rows: int, vocab: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(0, 2, (num_rows, vocab)).astype(np.float32))
    prompt = rng.integers(0, vocab, 512).tolist()
    output = rng.integers(0, vocab, 128).tolist()
    result = {}
    for name, (params, k) in MIXES.items():
        rows = [
            SamplingRow(f"r{i}", params, tuple(prompt) + tuple(output), len(prompt), (2,))
            for i in range(num_rows)
        ]

        def build(rows=rows):
            return make_sampling_metadata(
                rows, num_rows=num_rows, vocab_size=vocab, global_seed=0, step=1
            )

        md = build()
        sample(logits, md, num_logprobs=k).token_ids.block_until_ready()
        result[name] = {
            "sample_ms": _median_ms(
                lambda md=md, k=k: sample(logits, md, num_logprobs=k).token_ids.block_until_ready(),
                repeats,
            ),
            "metadata_ms": _median_ms(build, repeats),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = {
        "rows": args.rows,
        "vocab": args.vocab,
        "backend": jax.default_backend(),
        "mixes": run(args.rows, args.vocab, args.repeats),
    }
    if args.json:
        print(json.dumps(result))
        return
    for name, r in result["mixes"].items():
        print(f"{name:8s} sample {r['sample_ms']:8.2f} ms   metadata {r['metadata_ms']:8.2f} ms")


if __name__ == "__main__":
    main()
