"""Throughput of KV-cache transitions (allocate, free, prefix lookup) at several pool sizes.

For each pool size, requests of `--blocks-per-request` full blocks fill the whole pool:
- a first round allocates them from never-used blocks, registering every block's hash, then frees;
- each steady-state round allocates the other of two request sets, so every block comes off the
  LRU list and evicts a cached hash (a busy engine), frees them, then looks their (now cached,
  free) hash chains up with `find_cached_prefix`.
Reported figures are microseconds of this process's CPU time per block (so other load on the
machine does not count), medians over the steady-state rounds.

    python3 benchmarks/kv_cache_ops.py --json
"""

import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass

from runtime.core.kv import kv_cache as kv

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


def measure(num_blocks: int, block_size: int, blocks_per_request: int, rounds: int) -> dict:
    num_requests = (num_blocks - 1) // blocks_per_request
    num_tokens = blocks_per_request * block_size
    sets = (
        _make_requests(0, num_requests, num_tokens, block_size),
        _make_requests(num_requests * num_tokens, num_requests, num_tokens, block_size),
    )
    num_alloc = num_requests * blocks_per_request
    state = kv.make_kv_cache(num_blocks, block_size, max_model_len=num_tokens)
    state, fresh_s = _allocate_all(state, sets[0], "a")
    state, _ = _free_all(state, num_requests, "a")
    times: dict[str, list[float]] = {"alloc": [], "free": [], "lookup": []}
    for round_index in range(rounds):
        requests = sets[(round_index + 1) % 2]
        # Every block comes off the LRU list and evicts the other set's cached hash.
        state, alloc_s = _allocate_all(state, requests, "b")
        assert kv.num_free_blocks(state) == num_blocks - 1 - num_alloc
        state, free_s = _free_all(state, num_requests, "b")
        hits, lookup_s = _lookup_all(state, requests)
        # All but each request's last block hit (N-1 rule).
        assert hits == num_requests * (blocks_per_request - 1), hits
        times["alloc"].append(alloc_s * 1e6 / num_alloc)
        times["free"].append(free_s * 1e6 / num_alloc)
        times["lookup"].append(lookup_s * 1e6 / hits)
    return {
        "alloc_fresh_us_per_block": fresh_s * 1e6 / num_alloc,
        **{f"{op}_us_per_block": statistics.median(values) for op, values in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-request", type=int, default=32)
    parser.add_argument(
        "--rounds", type=int, default=5, help="steady-state rounds at the largest pool"
    )
    args = parser.parse_args()

    results = {}
    for num_blocks in POOL_SIZES:
        # Smaller pools run more rounds so each size times about as many blocks in all.
        rounds = args.rounds * POOL_SIZES[-1] // num_blocks
        results[num_blocks] = measure(num_blocks, args.block_size, args.blocks_per_request, rounds)
        gc.collect()

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
        "rounds_at_largest_pool": args.rounds,
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
