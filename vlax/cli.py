"""The `vlax` command line: `vlax generate ...`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from runtime.core.request import SamplingParams


def _read_prompts(path: Path) -> list:
    if not path.is_file():
        raise SystemExit(f"vlax: --prompts {path}: no such file")
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"vlax: {path}:{n}: not valid JSON ({e})") from None
            if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & item.keys()):
                raise SystemExit(
                    f"vlax: {path}:{n}: expected an object with 'prompt' or 'prompt_token_ids'"
                )
            prompts.append(item)
        return prompts
    return [line for line in path.read_text().splitlines() if line.strip()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlax", description="vlax: offline LLM inference")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.add_argument(
        "--model", help="HF checkpoint folder (default: the embedded random-weight model)"
    )
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts", type=Path, help=".txt (one prompt a line) or .jsonl file")
    g.add_argument("--output", type=Path, help="write one JSON object per prompt to this .jsonl")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--attention-backend", default="auto", choices=("auto", "pallas", "reference"))
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--sample-seed", type=int, help="per-request seed")
    s.add_argument("--n", type=int, default=1)
    s.add_argument("--stop", action="append", default=[])
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int)
    g.add_argument("--no-progress", action="store_true")
    return ap


def generate(args) -> int:
    from vlax import LLM

    prompts = list(args.prompt) + (_read_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise SystemExit("vlax generate: give at least one --prompt or a --prompts file")
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    if args.model is None:
        print(
            "vlax: no --model given: using the embedded default checkpoint (RANDOM weights, "
            "so the text is gibberish; it shows the engine works).",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        seed=args.seed,
    )
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    t2 = time.perf_counter()
    rows = []
    for out in outs:
        for c in out.outputs:
            rows.append(
                {
                    "request_id": out.request_id,
                    "index": c.index,
                    "prompt": out.prompt,
                    "prompt_token_ids": out.prompt_token_ids,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "cumulative_logprob": c.cumulative_logprob,
                }
            )
    if args.output:
        with args.output.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    else:
        for r in rows:
            print(f"[{r['request_id']}.{r['index']}] {r['prompt']!r} -> {r['text']!r}")
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(r["token_ids"]) for r in rows)
    gen_s = max(t2 - t1, 1e-9)
    print(
        f"vlax: {len(outs)} prompts, {n_prompt} prompt tokens, {n_out} output tokens in "
        f"{gen_s:.2f} s ({n_out / gen_s:.1f} output tok/s, {(n_prompt + n_out) / gen_s:.1f} total "
        f"tok/s); engine start-up {t1 - t0:.2f} s",
        file=sys.stderr,
    )
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "generate":
        try:
            return generate(args)
        except (ValueError, TypeError) as e:
            print(f"vlax generate: {e}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
