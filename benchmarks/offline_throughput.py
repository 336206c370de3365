"""Offline batch throughput: vlax `LLM.generate` vs HF transformers `generate` on the same checkpoint.

    python -m benchmarks.offline_throughput [--json] [--dtypes float32,bfloat16] [--requests 64]

A ~50M-parameter Llama (hidden 512, 8 layers, 8 heads, 2 KV heads, vocab 32000, random weights) and a
seeded workload: prompt lengths uniform in 32-512, output lengths uniform in 16-256, greedy, ignore_eos.
vlax takes all requests at once; HF runs `generate` on left-padded batches of 16 (the way users batch
with it), each batch until its longest request is done, and is credited only the tokens asked for.
Each side runs once as a warm-up (compilation, allocator) and is then timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
HF_BATCH = 16


def workload(num_requests: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(3, CONFIG["vocab_size"], rng.integers(32, 513)).tolist()
        for _ in range(num_requests)
    ]
    out_lens = rng.integers(16, 257, num_requests).tolist()
    return prompts, out_lens


def write_checkpoint(path: str, dtype: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)


def num_params(cfg=CONFIG) -> tuple[int, int]:
    """(matmul parameters per token, embedding parameters)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return per_layer * layers + h * cfg["vocab_size"], h * cfg["vocab_size"]


def model_flops(prompts, out_lens) -> float:
    """2 * matmul params per token plus attention (QK and PV, 4 * d_model * context per layer)."""
    matmul, _ = num_params()
    h, layers = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
    flops = 0.0
    for p, o in zip(prompts, out_lens, strict=True):
        n = len(p) + o
        flops += 2 * matmul * n + 4 * h * layers * n * (n + 1) / 2
    return flops


def peak_flops(dtype: str) -> float:
    import jax
    import jax.numpy as jnp

    n = 2048
    a = jnp.ones((n, n), dtype) * 0.01
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_vlax(path, prompts, out_lens, dtype):
    from vlax import LLM, SamplingParams

    llm = LLM(
        path,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        block_size=16,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in out_lens]
    batch = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up on prompts of the same lengths but other tokens: it compiles every bucket the timed
    # run uses without leaving prefix-cache hits for it.
    vocab = CONFIG["vocab_size"]
    other = [{"prompt_token_ids": [3 + (t + 7) % (vocab - 3) for t in p]} for p in prompts]
    llm.generate(other, params, use_tqdm=False)
    before = dataclasses.replace(llm.engine.totals)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == list(out_lens), "vlax produced the wrong number of tokens"
    after = llm.engine.totals
    counts = {
        name: getattr(after, name) - getattr(before, name)
        for name in ("steps", "prefill_tokens", "decode_tokens")
    }
    return elapsed, counts


def run_hf(path, prompts, out_lens, dtype):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()

    def one_pass(limit=None):
        total = 0
        items = list(zip(prompts, out_lens, strict=True))[:limit]
        for b in range(0, len(items), HF_BATCH):
            chunk = items[b : b + HF_BATCH]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max(o for _, o in chunk),
                    min_new_tokens=0,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            total += sum(o for _, o in chunk)
        return total

    one_pass(limit=HF_BATCH)  # warm-up
    t0 = time.perf_counter()
    one_pass()
    return time.perf_counter() - t0


def measure(dtype: str, num_requests: int, tmp: str) -> dict:
    path = os.path.join(tmp, dtype)
    write_checkpoint(path, dtype)
    prompts, out_lens = workload(num_requests)
    out_tokens = sum(out_lens)
    vlax_s, counts = run_vlax(path, prompts, out_lens, dtype)
    hf_s = run_hf(path, prompts, out_lens, dtype)
    prefill_tok, decode_tok = counts["prefill_tokens"], counts["decode_tokens"]
    peak = peak_flops(dtype)
    return {
        "vlax_tok_s": out_tokens / vlax_s,
        "hf_tok_s": out_tokens / hf_s,
        "ratio": hf_s / vlax_s,
        "vlax_s": vlax_s,
        "hf_s": hf_s,
        "vlax_prefill_tok_s": prefill_tok / vlax_s,
        "vlax_decode_tok_s": decode_tok / vlax_s,
        "vlax_steps": counts["steps"],
        "mfu": model_flops(prompts, out_lens) / vlax_s / peak,
        "peak_matmul_gflop_s": peak / 1e9,
        "output_tokens": out_tokens,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args(argv)
    result = {"machine": f"{os.cpu_count()} CPU cores", "requests": args.requests}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            result[dtype] = measure(dtype, args.requests, tmp)
            if not args.json:
                print(dtype, json.dumps(result[dtype], indent=1), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
