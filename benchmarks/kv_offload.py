"""KV store throughput: 256 blocks of 64 KiB through each store, batched put then get.

- host: HostStore in /dev/shm, in this process;
- mooncake: MooncakeStore against a mooncake_master this script starts; Mooncake's sockets bind
  0.0.0.0, so that part re-runs this script inside a private network namespace (`unshare -n`,
  needs root) and reports why it was skipped otherwise;
- host_jobs: the whole store-job path on device arrays (gather, copy to host, put) and the load
  path (get, write into the KV cache), through KVOffloader;
  these figures are MiB/s, medians over `--repeats` rounds after one warm-up round.
- ttft_2k_prefix: end to end through the engine on the ~50M-parameter Llama of
  offline_throughput.py (float32, random weights): the time to first token (max_tokens=1) of a
  request whose 2048-token prefix an earlier request stored and a third request then evicted from
  the device pool, with kv_offload="host" (the prefix is loaded) vs off (it is recomputed); medians
  over `--repeats` rounds, each on fresh prefixes, after one warm-up round per engine.

    python3 benchmarks/kv_offload.py --json
"""

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_BLOCKS, BLOCK_BYTES = 256, 64 << 10
MIB = NUM_BLOCKS * BLOCK_BYTES / 2**20
PORT = 47751


def _keys(round_: int):
    return [hashlib.sha256(b"%d/%d" % (round_, i)).digest() for i in range(NUM_BLOCKS)]


def _store_rates(store, repeats: int) -> dict:
    values = [os.urandom(BLOCK_BYTES) for _ in range(NUM_BLOCKS)]
    puts, gets = [], []
    for round_ in range(repeats + 1):
        keys = _keys(round_)
        start = time.perf_counter()
        assert all(store.put(keys, values).stored)
        middle = time.perf_counter()
        got = store.get(keys)
        end = time.perf_counter()
        assert got[0] == values[0] and got[-1] == values[-1]
        if round_:
            puts.append(MIB / (middle - start))
            gets.append(MIB / (end - middle))
        store.remove(keys)
    return {"store_mib_s": statistics.median(puts), "load_mib_s": statistics.median(gets)}


def _host(repeats: int) -> dict:
    from runtime.offload.host_store import HostStore

    with HostStore(2 * NUM_BLOCKS * BLOCK_BYTES, BLOCK_BYTES) as store:
        return _store_rates(store, repeats)


def _host_jobs(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from runtime.core.kv_jobs.jobs import LoadJob, StoreJob
    from runtime.offload.host_store import HostStore
    from runtime.offload.offloader import KVOffloader

    # 4 layers x (k, v) x [blocks, 16 tokens, 4 heads, 64] bf16 = 64 KiB per block.
    shape = (NUM_BLOCKS + 1, 16, 4, 64)
    kv = tuple((jnp.ones(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16) * 2) for _ in range(4))
    ids = tuple(range(1, NUM_BLOCKS + 1))
    offloader = KVOffloader(HostStore(2 * NUM_BLOCKS * BLOCK_BYTES, BLOCK_BYTES))
    stores, loads, job_id = [], [], 0
    for round_ in range(repeats + 1):
        keys = tuple(_keys(round_))
        job_id += 1
        start = time.perf_counter()
        offloader.start(kv, [StoreJob(job_id, "r", ids, keys)])
        kv, done = offloader.finish(kv, wait_s=60)
        middle = time.perf_counter()
        job_id += 1
        offloader.start(kv, [LoadJob(job_id, "r", ids, keys, 0)])
        kv, done2 = offloader.finish(kv, wait_s=60)
        jax.block_until_ready(kv)
        end = time.perf_counter()
        assert done[0].ok and done2[0].ok, offloader.errors
        if round_:
            stores.append(MIB / (middle - start))
            loads.append(MIB / (end - middle))
        offloader.store.remove(keys)
    offloader.close()
    return {"store_mib_s": statistics.median(stores), "load_mib_s": statistics.median(loads)}


def _mooncake_inside(repeats: int) -> dict:
    from benchmarks.mooncake_master import connect_store, start_master, stop_master

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    master = start_master(PORT)
    try:
        store = connect_store(
            PORT,
            BLOCK_BYTES,
            namespace="bench",
            segment_bytes=256 << 20,
            buffer_bytes=64 << 20,
            timeout_s=20,
        )
        with store:
            return _store_rates(store, repeats)
    finally:
        stop_master(master)


def _mooncake(repeats: int) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "needs root for a private network namespace (unshare -n)"}
    done = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            os.path.abspath(__file__),
            "--mooncake-inside",
            "--repeats",
            str(repeats),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


PREFIX, SUFFIX, TTFT_BLOCK = 2048, 16, 16
# The pool holds one request of max_model_len tokens; the evictor's prompt (and its one sampled
# token) fills every usable block, so no block of the prefix survives on the device.
TTFT_POOL_BLOCKS = (PREFIX + SUFFIX) // TTFT_BLOCK + 7
MAX_MODEL_LEN = (TTFT_POOL_BLOCKS - 1) * TTFT_BLOCK
EVICTOR_LEN = MAX_MODEL_LEN - 1


def _ttft_engine(checkpoint: str, offload: bool):
    from vlax import LLM

    extra = dict(kv_offload="host", kv_offload_bytes=1 << 30) if offload else {}
    return LLM(
        checkpoint,
        max_model_len=MAX_MODEL_LEN,
        block_size=TTFT_BLOCK,
        num_kv_blocks=TTFT_POOL_BLOCKS,
        max_num_seqs=1,
        **extra,
    ).engine


def _serve(engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the request's first (only) token, and the prefill tokens it computed;
    then drain the engine (its store jobs) untimed."""
    from runtime.core.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = engine.totals.prefill_tokens
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while not any(t.request_id == request_id for t in engine.step()):
        pass
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, engine.totals.prefill_tokens - first


def _ttft_round(engine, round_: int, rng) -> tuple[float, int]:
    vocab = 32000
    prefix = rng.integers(3, vocab, PREFIX).tolist()
    _serve(engine, f"{round_}-first", prefix + rng.integers(3, vocab, SUFFIX).tolist())
    _serve(engine, f"{round_}-evictor", rng.integers(3, vocab, EVICTOR_LEN).tolist())
    return _serve(engine, f"{round_}-again", prefix + rng.integers(3, vocab, SUFFIX).tolist())


def _ttft(repeats: int) -> dict:
    import tempfile

    import numpy as np
    import torch
    import transformers

    from benchmarks.offline_throughput import CONFIG

    result = {"prefix_tokens": PREFIX, "suffix_tokens": SUFFIX, "block_size": TTFT_BLOCK}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**{**CONFIG, "max_position_embeddings": 4096})
        transformers.LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
        for name, offload in (("recompute", False), ("host_store", True)):
            engine = _ttft_engine(tmp, offload)
            rng = np.random.default_rng(0)
            rounds = [_ttft_round(engine, r, rng) for r in range(repeats + 1)][1:]
            result[name] = {
                "ttft_s": statistics.median(s for s, _ in rounds),
                "prefill_tokens": sorted({n for _, n in rounds}),
            }
            if offload:
                result[name]["offload_stats"] = dataclasses.asdict(engine.offload_stats)
            engine.close()
    result["speedup"] = result["recompute"]["ttft_s"] / result["host_store"]["ttft_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mooncake-inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mooncake_inside:
        print(json.dumps(_mooncake_inside(args.repeats)))
        return
    result = {
        "blocks": NUM_BLOCKS,
        "block_bytes": BLOCK_BYTES,
        "host": _host(args.repeats),
        "host_jobs": _host_jobs(args.repeats),
        "mooncake": _mooncake(args.repeats),
        "ttft_2k_prefix": _ttft(args.repeats),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name}: {value}")


if __name__ == "__main__":
    main()
