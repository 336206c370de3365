"""Throughput of KV-cache transitions (allocate, free, prefix lookup) at several pool sizes.

For each pool size, requests of `--blocks-per-request` full blocks fill the whole pool:
- round 1 allocates them from never-used blocks, registering every block's hash, then frees them;
- round 2 allocates a second, different set of requests, so every block comes off the LRU list and
  evicts a cached hash (the steady state of a busy engine), then frees them;
- lookup walks the hash chains of round 2's (now cached, free) requests with `find_cached_prefix`.
Reported figures are microseconds of this process's CPU time per block (so other load on the
machine does not count), medians over `--repeats` runs; the headline alloc / free figures are
round 2's.

    python3 benchmarks/kv_cache_ops.py --json
"""

import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass

from runtime.core import kv_cache as kv

POOL_SIZES = (4096, 32768, 262144)


@dataclass(frozen=True, slots=True)
class _Request:
    block_hashes: tuple[bytes, ...]
    num_tokens: int


def _make_requests(first_token: int, num_requests: int, num_tokens: int, block_size: int):
    requests = []
    for index in range(num_requests):
        start = first_token + index * num_tokens
        tokens = range(start, start + num_tokens)
        requests.append(_Request(kv.extend_block_hashes((), tokens, block_size), num_tokens))
    return requests


def _allocate_all(state, requests, prefix):
    start = time.process_time()
    for index, request in enumerate(requests):
        result = kv.allocate_slots(
            state, f"{prefix}{index}", request.num_tokens, 0, block_hashes=request.block_hashes
        )
        state = result.state
    return state, time.process_time() - start


def _free_all(state, num_requests, prefix):
    start = time.process_time()
    for index in range(num_requests):
        state = kv.free(state, f"{prefix}{index}")
    return state, time.process_time() - start


def _lookup_all(state, requests):
    start = time.process_time()
    hits = 0
    for request in requests:
        hits += len(kv.find_cached_prefix(state, request).blocks)
    return hits, time.process_time() - start


def measure(num_blocks: int, block_size: int, blocks_per_request: int) -> dict[str, float]:
    num_requests = (num_blocks - 1) // blocks_per_request
    num_tokens = blocks_per_request * block_size
    first = _make_requests(0, num_requests, num_tokens, block_size)
    second = _make_requests(num_requests * num_tokens, num_requests, num_tokens, block_size)
    num_alloc = num_requests * blocks_per_request

    state = kv.make_kv_cache(num_blocks, block_size, max_model_len=num_tokens)
    state, fresh_s = _allocate_all(state, first, "a")
    state, free_fresh_s = _free_all(state, num_requests, "a")
    state, alloc_s = _allocate_all(state, second, "b")
    assert kv.num_free_blocks(state) == num_blocks - 1 - num_alloc
    state, free_s = _free_all(state, num_requests, "b")
    hits, lookup_s = _lookup_all(state, second)
    # Round 2 evicted every round-1 block, and round 2 must hit all but the last block (N-1 rule).
    assert hits == num_requests * (blocks_per_request - 1), hits
    per_block = 1e6 / num_alloc
    return {
        "alloc_fresh_us_per_block": fresh_s * per_block,
        "alloc_us_per_block": alloc_s * per_block,
        "free_us_per_block": free_s * per_block,
        "lookup_us_per_block": lookup_s * 1e6 / hits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-request", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    results = {}
    for num_blocks in POOL_SIZES:
        runs = [
            measure(num_blocks, args.block_size, args.blocks_per_request)
            for _ in range(args.repeats)
        ]
        gc.collect()
        results[num_blocks] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}

    def total(num_blocks: int) -> float:
        row = results[num_blocks]
        return row["alloc_us_per_block"] + row["free_us_per_block"] + row["lookup_us_per_block"]

    small, mid, large = POOL_SIZES
    report = {
        **{key: round(value, 3) for key, value in results[mid].items()},
        "pool_scaling": round(total(large) / total(small), 3),
        "pool_scaling_alloc": round(
            results[large]["alloc_us_per_block"] / results[small]["alloc_us_per_block"], 3
        ),
        "pool_scaling_free": round(
            results[large]["free_us_per_block"] / results[small]["free_us_per_block"], 3
        ),
        "per_pool_size": {
            str(n): {key: round(value, 3) for key, value in row.items()}
            for n, row in results.items()
        },
        "block_size": args.block_size,
        "blocks_per_request": args.blocks_per_request,
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps(report))
        return
    for num_blocks, row in results.items():
        cells = "  ".join(f"{key}={value:.3f}" for key, value in row.items())
        print(f"{num_blocks:>7} blocks  {cells}")
    print(
        f"pool_scaling (alloc+free+lookup per block, {large} vs {small}): {report['pool_scaling']}"
    )


if __name__ == "__main__":
    main()
