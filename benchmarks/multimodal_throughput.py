"""Multimodal generation throughput: vlax `LLM.generate` with images vs HF transformers.

    python -m benchmarks.multimodal_throughput [--json] [--requests 200] [--images 20] [--seed 0]

The model is a random PaliGemma-architecture checkpoint of about 50M parameters (SigLIP tower:
hidden 384, 6 layers, 128x128 images in 16x16 patches = 64 image tokens; Gemma: hidden 512,
8 layers, 4 heads of 128, 1 KV head, vocabulary 16384), written once to a temporary directory.
The workload is seeded: `--requests` prompts, each one of `--images` distinct images (random
uint8 pictures of random sizes, 64..320 pixels a side) with 16 random text tokens, greedy for 16
new tokens (EOS ignored). Every prompt has the same length, so HF batches need no padding.

Both sides run float32 on this machine and preprocess the images themselves (vlax with its own
Pillow + numpy path, HF with SiglipImageProcessorPil). vlax: one engine with its defaults (prefix
caching on; chunked prefill off, as PaliGemma's prefix LM needs; vLLM's offline-LLM batch limits
on the CPU, 256 sequences and 4096 tokens a step, so the whole workload decodes in one batch:
9% less time than 64 sequences on the 2-core dev machine), the whole workload in one
`generate` call; it warms up first on the same workload shapes with other images (every batch
shape compiled, the encoder cache left without the timed images). HF: `generate` over batches of
16 in input order, with token_type_ids 0 over image and prompt (its prefix LM), warmed up on one
batch. The JSON gives requests/s of each side, the ratio vlax / HF, vlax's encoder runs (images
its vision tower encoded in the timed run; HF encodes every request's image), and how many
requests' tokens agree between the two sides.

The JSON also gives each side's model FLOPs (`model_flops`: the vision tower for each image that
side encoded, the projector, the text layers over every prompt and generated token with their
attention, the LM head once per generated token), the host's f32 matmul peak
(benchmarks/matmul_peak.py), each side's MFU, and `ratio_at_peak`: the ratio vlax would reach
running its model FLOPs at that peak. Both count the same model work for vlax, though vlax skips
some of it (the last layer's MLP of the prompt tokens it samples nothing from: model/base.py
`forward`), so its MFU may pass what it computes, and its ratio may pass ratio_at_peak.

Each side also gives the CPU seconds of its timed region (process time, all threads) and the JSON
their ratio (cpu_ratio): on a machine other processes load, wall time follows their load as much
as ours, while CPU time counts the work each side did (plus whatever its threads spin); the ratio
the target is about is `ratio`, measured on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np

from benchmarks.matmul_peak import peak_flops

IMAGE_SIZE, PATCH = 128, 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
VOCAB = 16384
IMAGE_TOKEN = VOCAB - 1
TEXT_TOKENS = 16
NEW_TOKENS = 16
HF_BATCH = 16
VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=6,
    image_size=IMAGE_SIZE,
    patch_size=PATCH,
    vision_use_head=False,
)
TEXT = dict(
    model_type="gemma",
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    max_position_embeddings=512,
)


def write_checkpoint(directory: str, seed: int) -> int:
    """A random PaliGemma checkpoint; returns its parameter count."""
    import torch
    import transformers

    config = transformers.PaliGemmaConfig(
        vision_config=VISION,
        text_config=TEXT,
        image_token_index=IMAGE_TOKEN,
        vocab_size=VOCAB,
        projection_dim=TEXT["hidden_size"],
    )
    torch.manual_seed(seed)
    model = transformers.PaliGemmaForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=generator, dtype=torch.float32))
    model.eval().save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def vision_flops() -> float:
    """One image: patch embedding, the SigLIP layers (bidirectional over its tokens), and the
    projector into the text's hidden size."""
    h, inter, layers = (
        VISION["hidden_size"],
        VISION["intermediate_size"],
        VISION["num_hidden_layers"],
    )
    n = NUM_IMAGE_TOKENS
    patch = 2 * n * 3 * PATCH * PATCH * h
    per_layer = 2 * n * (4 * h * h + 2 * h * inter) + 4 * h * n * n
    return patch + layers * per_layer + 2 * n * h * TEXT["hidden_size"]


def text_flops(prompt_len: int, new_tokens: int) -> float:
    """One request's Gemma layers: the prompt (image and text tokens, each attending the whole
    prompt: PaliGemma's prefix), then each generated token fed back (the last is never fed),
    attending every position before it; the LM head once per generated token."""
    h, inter, layers = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["num_hidden_layers"]
    q = TEXT["num_attention_heads"] * TEXT["head_dim"]
    kv = TEXT["num_key_value_heads"] * TEXT["head_dim"]
    dense = 2 * (2 * h * q + 2 * h * kv + 3 * h * inter)
    keys = prompt_len * prompt_len + sum(prompt_len + j + 1 for j in range(new_tokens - 1))
    tokens = prompt_len + new_tokens - 1
    return layers * (tokens * dense + 4 * q * keys) + new_tokens * 2 * h * VOCAB


def workload(requests: int, images: int, seed: int):
    """(images, [(image index, text token ids)]) for `requests` prompts over `images` images."""
    rng = np.random.default_rng(seed)
    pictures = [
        rng.integers(0, 256, (int(rng.integers(64, 321)), int(rng.integers(64, 321)), 3), np.uint8)
        for _ in range(images)
    ]
    prompts = [
        (int(rng.integers(0, images)), rng.integers(3, IMAGE_TOKEN, TEXT_TOKENS).tolist())
        for _ in range(requests)
    ]
    return pictures, prompts


def run_vlax(path: str, pictures, prompts, warm_pictures):
    from vlax import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def requests(images):
        return [
            {"prompt_token_ids": text, "multi_modal_data": {"image": images[i]}}
            for i, text in prompts
        ]

    llm.generate(requests(warm_pictures), params, use_tqdm=False)
    path_ = llm.engine.runner.encoder_path
    before = path_.num_encoded
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(requests(pictures), params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, cpu, path_.num_encoded - before, [list(o.outputs[0].token_ids) for o in outs]


def run_hf(path: str, pictures, prompts):
    import torch
    import transformers
    from PIL import Image
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    model = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})

    def batch(chunk):
        pixels = processor(
            images=[Image.fromarray(pictures[i]) for i, _ in chunk], return_tensors="pt"
        )["pixel_values"]
        ids = torch.tensor([[IMAGE_TOKEN] * NUM_IMAGE_TOKENS + text for _, text in chunk])
        with torch.no_grad():
            out = model.generate(
                ids,
                pixel_values=pixels,
                attention_mask=torch.ones_like(ids),
                token_type_ids=torch.zeros_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()

    batch(prompts[:HF_BATCH])  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    tokens = []
    for k in range(0, len(prompts), HF_BATCH):
        tokens += batch(prompts[k : k + HF_BATCH])
    return time.perf_counter() - start, time.process_time() - cpu, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    pictures, prompts = workload(args.requests, args.images, args.seed)
    warm_pictures, _ = workload(1, args.images, args.seed + 1000)
    with tempfile.TemporaryDirectory() as directory:
        num_params = write_checkpoint(directory, args.seed)
        result = {
            "model": "PaliGemma architecture, random weights",
            "parameters": num_params,
            "image_tokens": NUM_IMAGE_TOKENS,
            "dtype": "float32",
            "requests": len(prompts),
            "distinct_images": args.images,
            "text_tokens": TEXT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "seed": args.seed,
        }
        vlax_s, vlax_cpu, encoder_runs, ours = run_vlax(directory, pictures, prompts, warm_pictures)
        result["vlax"] = {
            "seconds": vlax_s,
            "cpu_seconds": vlax_cpu,
            "requests_per_s": len(prompts) / vlax_s,
            "encoder_runs": encoder_runs,
        }
        if not args.json:
            print("vlax", json.dumps(result["vlax"]), file=sys.stderr)
        hf_s, hf_cpu, theirs = run_hf(directory, pictures, prompts)
    result["hf"] = {
        "seconds": hf_s,
        "cpu_seconds": hf_cpu,
        "requests_per_s": len(prompts) / hf_s,
        "batch_size": HF_BATCH,
        "encoder_runs": len(prompts),
    }
    result["ratio"] = hf_s / vlax_s
    peak = peak_flops("float32")
    text = len(prompts) * text_flops(NUM_IMAGE_TOKENS + TEXT_TOKENS, NEW_TOKENS)
    result["peak_matmul_gflop_s"] = peak / 1e9
    for side, seconds in (("vlax", vlax_s), ("hf", hf_s)):
        flops = text + result[side]["encoder_runs"] * vision_flops()
        result[side]["model_flops"] = flops
        result[side]["mfu"] = flops / seconds / peak
    result["ratio_at_peak"] = hf_s / (result["vlax"]["model_flops"] / peak)
    result["cpu_ratio"] = hf_cpu / vlax_cpu
    result["same_tokens"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
