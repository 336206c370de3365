"""Tensor parallelism: per-device memory and the collectives of one decode step, by TP size.

    python -m benchmarks.scale_out [--json] [--tp 1,2,4] [--devices 4] [--throughput]

On the CPU the devices are simulated (`--xla_force_host_platform_device_count`, set here before
JAX starts). For each TP size an engine serves the same seeded greedy workload on a random-weight
Llama (hidden 512, 4 layers, 8 heads, 4 KV heads, intermediate 1408, vocab 8192, float32), and the
table gives:

- weight and KV cache bytes held by each device (every device holds the same);
- the collectives of the compiled decode step (XLA's optimized HLO of the jitted step of the last
  engine step, a decode of every sequence), by kind, against the minimum for this layout: two
  all-reduces per layer (after o_proj and down_proj, the Megatron/vLLM count), one more for the
  vocabulary-split embedding lookup, and one all-gather of the logits for sampling;
- with --throughput (default on GPUs), output tokens per second over the timed run of the
  workload (after a warm-up run). Simulated CPU devices share the host's cores, so CPU figures say
  nothing about real scaling and are left out unless asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

LAYERS = 4
CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 16, 64, 32
# Collective ops of XLA's HLO; async pairs are counted once, by their -start.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*\S+\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _OP.finditer(hlo_text):
        counts[match.group(1)] += 1
    return counts


def minimum(layers: int, tp: int) -> dict[str, int]:
    """The collectives this layout needs per decode step (none on one device)."""
    if tp == 1:
        return dict.fromkeys(COLLECTIVES, 0)
    return {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 2 * layers + 1, "all-gather": 1}


def write_checkpoint(directory: str) -> str:
    from model.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(directory, "llama", seed=0, **CONFIG)


def run_one(path: str, tp: int, throughput: bool) -> dict:
    import jax
    import numpy as np

    from runtime.core.request import SamplingParams
    from runtime.runner import model_runner
    from runtime.runner.parallel import bytes_per_device
    from vlax import LLM

    llm = LLM(
        path,
        tensor_parallel_size=tp,
        max_model_len=PROMPT_LEN + MAX_TOKENS,
        max_num_seqs=NUM_PROMPTS,
        block_size=16,
    )
    runner = llm.engine.runner
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, CONFIG["vocab_size"], PROMPT_LEN).tolist()}
        for _ in range(NUM_PROMPTS)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    # The jitted step's arguments as shapes and shardings, at each call (the last is a decode).
    step, seen = model_runner._step, {}

    def shape_of(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    def spy(*args, **kwargs):
        seen["args"] = jax.tree_util.tree_map(shape_of, args)
        seen["kwargs"] = kwargs
        return step(*args, **kwargs)

    spy.lower = step.lower  # the warm-up compiles the real step ahead of the run
    model_runner._step = spy
    try:
        llm.generate(prompts, greedy, use_tqdm=False)  # warm-up: compiles every bucket
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        model_runner._step = step
    with runner._on_mesh():
        hlo = step.lower(*seen["args"], **seen["kwargs"]).compile().as_text()
    weights, kv = bytes_per_device(runner.params), bytes_per_device(runner.kv_caches)
    row = {
        "tp": tp,
        "weight_bytes_per_device": max(weights.values()),
        "kv_bytes_per_device": max(kv.values()),
        "decode_tokens": int(seen["args"][3].token_ids.shape[0]),
        "collectives": count_collectives(hlo),
        "minimum": minimum(LAYERS, tp),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    if throughput:
        row["output_tok_s"] = NUM_PROMPTS * MAX_TOKENS / elapsed
    return row


def print_table(result: dict, throughput: bool) -> None:
    rows = result["rows"]
    print(
        f"{result['platform']}, {result['devices']} devices; Llama {LAYERS} layers; greedy tokens "
        f"identical across TP sizes: {result['tokens_identical_across_tp']}"
    )
    head = "tp  weights/dev MiB  KV/dev MiB  " + "  ".join(
        f"{c} (min)" for c in ("all-reduce", "all-gather", "other")
    )
    print(head + ("  tok/s" if throughput else ""))
    for r in rows:
        c, m = r["collectives"], r["minimum"]
        other = sum(v for k, v in c.items() if k not in ("all-reduce", "all-gather"))
        line = (
            f"{r['tp']:<3} {r['weight_bytes_per_device'] / 2**20:>15.2f} "
            f"{r['kv_bytes_per_device'] / 2**20:>11.2f}  "
            f"{c['all-reduce']:>6} ({m['all-reduce']:>2})  {c['all-gather']:>6} ({m['all-gather']})"
            f"  {other:>3} (0)"
        )
        if throughput:
            line += f"  {r['output_tok_s']:.1f}"
        print(line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--tp", default="1,2,4", help="TP sizes, comma-separated")
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    parser.add_argument("--throughput", action="store_true", help="tok/s (default on GPUs)")
    args = parser.parse_args(argv)
    sizes = [int(t) for t in args.tp.split(",")]
    if "jax" not in sys.modules:  # the flag counts only before JAX starts
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    import jax

    platform = jax.default_backend()
    throughput = args.throughput or platform != "cpu"
    skipped = [tp for tp in sizes if tp > jax.device_count()]
    sizes = [tp for tp in sizes if tp <= jax.device_count()]
    if skipped:
        print(f"skipped TP {skipped}: {jax.device_count()} {platform} devices", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp)
        rows = [run_one(path, tp, throughput) for tp in sizes]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    for r in rows:
        del r["tokens"]
    result = {
        "platform": platform,
        "devices": jax.device_count(),
        "model": CONFIG,
        "workload": dict(prompts=NUM_PROMPTS, prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS),
        "tokens_identical_across_tp": same,
        "skipped_tp": skipped,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print_table(result, throughput)
    return 0


if __name__ == "__main__":
    sys.exit(main())
