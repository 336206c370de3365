"""Offline batch throughput: vlax `LLM.generate` vs HF transformers `generate` on the same checkpoint.

    python -m benchmarks.offline_throughput [--json] [--family llama|deepseek_v32|kimi_linear]
        [--dtypes float32,bfloat16] [--requests N]

`--family llama` (the default): a ~50M-parameter Llama (hidden 512, 8 layers, 8 heads, 2 KV heads,
vocab 32000, random weights), float32 and bfloat16. `--family deepseek_v32`: a ~55M-parameter
DeepSeek-V3.2 of the same hidden size, depth and vocab (MLA with q_lora_rank 256, kv_lora_rank 128;
8 routed experts top-2 and one shared expert; DSA indexer with index_topk 256, so contexts past 256
tokens attend sparsely), float32 by default. `--family kimi_linear`: a ~57M-parameter Kimi-Linear of
the same hidden size, depth and vocab (6 KDA layers of 4 heads x 128 and 2 MLA layers, MoE as
DeepSeek's), float32 by default; HF runs its PyTorch reference KDA token by token, so this family
defaults to 32 requests (two HF batches; the other families 64): at 64 the HF side of a run on
this 2-core machine did not finish in 30 minutes under load. All run a seeded workload:
prompt lengths uniform in 32-512, output lengths uniform in 16-256, greedy, ignore_eos. vlax takes
all requests at once; HF runs `generate` on left-padded batches of 16 (the way users batch with it),
each batch until its longest request is done, and is credited only the tokens asked for. Each side
runs once as a warm-up (compilation, allocator) and is then timed. The JSON also gives the KV cache
bytes per token of the model run, pool by pool, next to the Llama model's (same hidden size), in the
cache dtype vlax used, and for a model with recurrent state (Kimi-Linear) its state bytes per
sequence.
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

from benchmarks.matmul_peak import peak_flops

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
# DeepSeek-V3.2 with the Llama's hidden size, depth and vocab (so the embeddings weigh the same);
# 54.6M parameters (the Llama: 55.3M), 46.3M of them active per token (2 of 8 experts).
DEEPSEEK_V32_CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,  # the dense MLP of the first layer
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    index_topk=256,
    index_head_dim=64,
    index_n_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Kimi-Linear with the Llama's hidden size, depth and vocab: KDA, KDA, KDA, MLA twice (4 KDA heads of
# 128; MLA without rope, kv_lora_rank 128); a dense first layer, then 8 routed experts top-2 and one
# shared expert. HF runs its PyTorch reference KDA (no fla on the CPU).
KIMI_LINEAR_CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,  # the dense MLP of the first layer
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    layer_types=["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    linear_num_heads=4,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    q_lora_rank=None,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    routed_scaling_factor=1.0,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# family -> (transformers config class, model class, config, dtypes run by default)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", CONFIG, "float32,bfloat16"),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        DEEPSEEK_V32_CONFIG,
        "float32",
    ),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", KIMI_LINEAR_CONFIG, "float32"),
}
HF_BATCH = 16
BLOCK_SIZE = 16
REQUESTS = 64
# Families whose HF side is too slow on a CPU for REQUESTS (see the docstring).
FAMILY_REQUESTS = {"kimi_linear": 32}


def workload(num_requests: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(3, CONFIG["vocab_size"], rng.integers(32, 513)).tolist()
        for _ in range(num_requests)
    ]
    out_lens = rng.integers(16, 257, num_requests).tolist()
    return prompts, out_lens


def hf_config(family: str = "llama"):
    """The transformers config of the family's benchmark model."""
    import transformers

    config_class, _, config, _ = FAMILIES[family]
    return getattr(transformers, config_class)(**config)


def hf_model(family: str = "llama"):
    """The family's benchmark model with random weights (seeded)."""
    import torch
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, FAMILIES[family][1])(hf_config(family))


def write_checkpoint(path: str, dtype: str, family: str = "llama") -> int:
    """Save the family's model as safetensors; returns its parameter count."""
    import torch

    model = hf_model(family).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def kv_bytes_per_token(family: str, cache_dtype: str) -> dict:
    """KV cache bytes per token of the family's benchmark model, in total and pool by pool, from the
    cache specs vlax allocates (no weights needed)."""
    from model import base, registry
    from model.base import ModelOptions
    from model.config import from_hf_dict

    _, model_class, _, _ = FAMILIES[family]
    hf = {**hf_config(family).to_dict(), "architectures": [model_class]}
    config = from_hf_dict(hf, dtype=cache_dtype)
    options = ModelOptions(block_size=BLOCK_SIZE, cache_dtype=cache_dtype)
    specs = registry.model_class(config.architecture).cache_specs(config, options)
    out = {
        "total": base.bytes_per_block(specs) // BLOCK_SIZE,
        "pools": {s.name: s.bytes_per_block // BLOCK_SIZE for s in base.paged_specs(specs)},
    }
    if base.has_state(specs):  # recurrent state: a fixed size per sequence, whatever its length
        out["state_bytes_per_sequence"] = base.bytes_per_slot(specs)
        out["state_pools"] = {s.name: s.bytes_per_slot for s in base.state_specs(specs)}
    return out


def num_params(cfg=CONFIG) -> tuple[int, int]:
    """(matmul parameters per token, embedding parameters)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return per_layer * layers + h * cfg["vocab_size"], h * cfg["vocab_size"]


def model_flops(prompts, out_lens) -> float:
    """2 * matmul params per token plus attention (QK and PV, 4 * d_model * context per layer):
    the model's work, of which vlax skips the last layer's MLP for prompt tokens it samples
    nothing from (model/base.py `forward`), so MFU counts a little more than it computes."""
    matmul, _ = num_params()
    h, layers = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
    flops = 0.0
    for p, o in zip(prompts, out_lens, strict=True):
        n = len(p) + o
        flops += 2 * matmul * n + 4 * h * layers * n * (n + 1) / 2
    return flops


def run_vlax(path, prompts, out_lens, dtype):
    from vlax import LLM, SamplingParams

    llm = LLM(
        path,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        block_size=BLOCK_SIZE,
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
    counts["cache_dtype"] = llm.engine.runner.kv_dtype
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


def measure(dtype: str, num_requests: int, tmp: str, family: str = "llama") -> dict:
    path = os.path.join(tmp, f"{family}-{dtype}")
    params = write_checkpoint(path, dtype, family)
    prompts, out_lens = workload(num_requests)
    out_tokens = sum(out_lens)
    vlax_s, counts = run_vlax(path, prompts, out_lens, dtype)
    # Progress on stderr: a CPU run of the HF side can take long after vlax is done.
    print(f"{family} {dtype} vlax: {out_tokens / vlax_s:.1f} tok/s", file=sys.stderr, flush=True)
    hf_s = run_hf(path, prompts, out_lens, dtype)
    print(f"{family} {dtype} HF: {out_tokens / hf_s:.1f} tok/s", file=sys.stderr, flush=True)
    prefill_tok, decode_tok = counts["prefill_tokens"], counts["decode_tokens"]
    result = {
        "params": params,
        "vlax_tok_s": out_tokens / vlax_s,
        "hf_tok_s": out_tokens / hf_s,
        "ratio": hf_s / vlax_s,
        "vlax_s": vlax_s,
        "hf_s": hf_s,
        "vlax_prefill_tok_s": prefill_tok / vlax_s,
        "vlax_decode_tok_s": decode_tok / vlax_s,
        "vlax_steps": counts["steps"],
        "output_tokens": out_tokens,
    }
    if family == "llama":  # model_flops counts a dense Llama's matmuls and attention
        peak = peak_flops(dtype)
        result["mfu"] = model_flops(prompts, out_lens) / vlax_s / peak
        result["peak_matmul_gflop_s"] = peak / 1e9
    cache_dtype = counts["cache_dtype"]
    result["kv_cache_dtype"] = cache_dtype
    result["kv_cache_bytes_per_token"] = {
        name: kv_bytes_per_token(name, cache_dtype) for name in dict.fromkeys((family, "llama"))
    }
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--dtypes", default=None, help="default: float32,bfloat16 (llama), float32")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (kimi_linear: 32)")
    args = ap.parse_args(argv)
    dtypes = args.dtypes or FAMILIES[args.family][3]
    requests = (
        args.requests if args.requests is not None else FAMILY_REQUESTS.get(args.family, REQUESTS)
    )
    result = {
        "machine": f"{os.cpu_count()} CPU cores",
        "family": args.family,
        "requests": requests,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes.split(","):
            result[dtype] = measure(dtype, requests, tmp, args.family)
            if not args.json:
                print(dtype, json.dumps(result[dtype], indent=1), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
