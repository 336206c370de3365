"""`vlax embed` and `vlax score`: pooling models from the command line.

    vlax embed --model DIR --input FILE(.txt|.jsonl) [--output out.jsonl]
    vlax score --model DIR --pairs FILE.jsonl [--output out.jsonl]

As `vlax generate`, every argument and input file is checked before JAX is imported, and a bad
one exits with status 2. Results are JSON lines in input order (on stdout without --output); the
throughput summary goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from runtime.config import EngineConfig
from runtime.core.request import PoolingParams
from vlax import arguments, engine_flags, logs

_EMBED_EPILOG = """\
input:
  .txt: one text a line (blank lines skipped). .jsonl: one object a line with 'text' (or
  'prompt') or 'prompt_token_ids'.
output:
  One JSON object a line, in input order: {"index": i, "num_tokens": n, "embedding": [...]}.
  The throughput summary (inputs/s, tokens/s) goes to stderr.
"""
_SCORE_EPILOG = """\
input:
  --pairs: .jsonl, one object a line with 'text_1' and 'text_2'. A cross-encoder (a one-label
  classification head) scores each pair together; an embedding model scores the cosine
  similarity of the two texts' embeddings.
output:
  One JSON object a line, in input order: {"index": i, "score": s}.
"""


COMMANDS = ("embed", "score")


def add_parsers(sub, formatter) -> None:
    e = sub.add_parser(
        "embed",
        help="embed texts with a pooling model",
        description="Embed texts, as vLLM's LLM.embed does.",
        epilog=_EMBED_EPILOG,
        formatter_class=formatter,
    )
    e.add_argument("--model", required=True, help="a local Hugging Face checkpoint folder")
    e.add_argument("--input", type=Path, required=True, help="a .txt or .jsonl file of texts")
    e.add_argument("--output", type=Path, help="write the embeddings to this .jsonl file")
    e.add_argument(
        "--dimensions", type=int, help="keep the first DIMENSIONS (matryoshka models only)"
    )
    e.add_argument("--no-normalize", action="store_true", help="do not L2-normalize the embeddings")
    s = sub.add_parser(
        "score",
        help="score text pairs with a cross-encoder or an embedding model",
        description="Score text pairs, as vLLM's LLM.score does.",
        epilog=_SCORE_EPILOG,
        formatter_class=formatter,
    )
    s.add_argument("--model", required=True, help="a local Hugging Face checkpoint folder")
    s.add_argument("--pairs", type=Path, required=True, help="a .jsonl file of text pairs")
    s.add_argument("--output", type=Path, help="write the scores to this .jsonl file")
    for p in (e, s):
        p.add_argument(
            "--runner",
            default="auto",
            choices=("auto", "pooling"),
            help="pooling: serve a generative checkpoint as a last-token embedder",
        )
        p.add_argument(
            "--truncate-prompt-tokens",
            type=int,
            help="keep this many tokens of each input (-1: max_model_len); default: refuse "
            "longer inputs",
        )
        engine_flags.add_engine_flags(p, pooling=True)
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("-v", "--verbose", action="store_true", help="log INFO lines on stderr")


def main(args) -> int:
    """Run `vlax embed` or `vlax score`; 2 for a bad argument or input (nothing runs then)."""
    if args.verbose:
        logs.set_level("INFO")
    command = embed if args.command == "embed" else score
    try:
        return command(args, engine_flags.engine_args(args, pooling=True))
    except (ValueError, TypeError) as e:
        print(f"vlax {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vlax {args.command}: interrupted", file=sys.stderr)
        return 130


def read_texts(path: Path) -> list:
    """The prompts of an --input file: texts (.txt) or prompt dicts (.jsonl)."""
    lines = _lines(path, "--input")
    if path.suffix == ".txt":
        return [line for line in lines if line.strip()]
    if path.suffix != ".jsonl":
        raise ValueError(f"--input {path}: expected a .txt or .jsonl file")
    prompts = []
    for n, item in _objects(path, lines):
        if "prompt_token_ids" in item:
            prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
        elif isinstance(item.get("text", item.get("prompt")), str):
            prompts.append(item.get("text", item.get("prompt")))
        else:
            raise ValueError(f"{path}:{n}: expected 'text' (a string) or 'prompt_token_ids'")
    return prompts


def read_pairs(path: Path) -> tuple[list[str], list[str]]:
    if path.suffix != ".jsonl":
        raise ValueError(f"--pairs {path}: expected a .jsonl file")
    firsts, seconds = [], []
    for n, item in _objects(path, _lines(path, "--pairs")):
        pair = item.get("text_1"), item.get("text_2")
        if not all(isinstance(t, str) for t in pair):
            raise ValueError(f"{path}:{n}: expected 'text_1' and 'text_2' strings")
        firsts.append(pair[0])
        seconds.append(pair[1])
    return firsts, seconds


def _lines(path: Path, flag: str) -> list[str]:
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        return path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None


def _objects(path: Path, lines: list[str]):
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object")
        yield n, item


def _check(args, engine_args: dict) -> None:
    EngineConfig(model=args.model, runner=args.runner, **engine_args)
    arguments.checkpoint_dir(args.model)
    if args.output is not None and not args.output.parent.is_dir():
        raise ValueError(f"--output {args.output}: folder {args.output.parent} does not exist")


def _write(rows, output: Path | None) -> None:
    sink = sys.stdout if output is None else output.open("w")
    try:
        for row in rows:
            sink.write(json.dumps(row) + "\n")
    finally:
        if output is not None:
            sink.close()


def _summary(command: str, num_inputs: int, num_tokens: int, t0: float, t1: float) -> None:
    run_s = max(time.perf_counter() - t1, 1e-9)
    print(
        f"vlax {command}: {num_inputs} inputs, {num_tokens} tokens in {run_s:.2f} s "
        f"({num_inputs / run_s:.1f} inputs/s, {num_tokens / run_s:.1f} tok/s); engine start-up "
        f"{t1 - t0:.2f} s",
        file=sys.stderr,
    )


def embed(args, engine_args: dict) -> int:
    prompts = read_texts(args.input)
    if not prompts:
        raise ValueError(f"--input {args.input}: no texts")
    params = PoolingParams(
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        dimensions=args.dimensions,
        normalize=False if args.no_normalize else None,
    )
    _check(args, engine_args)
    from vlax.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, runner=args.runner, **engine_args)
    t1 = time.perf_counter()
    outs = llm.embed(prompts, pooling_params=params, use_tqdm=not args.no_progress)
    _summary("embed", len(outs), sum(len(o.prompt_token_ids) for o in outs), t0, t1)
    _write(
        (
            {"index": i, "num_tokens": len(o.prompt_token_ids), "embedding": o.outputs.embedding}
            for i, o in enumerate(outs)
        ),
        args.output,
    )
    return 0


def score(args, engine_args: dict) -> int:
    firsts, seconds = read_pairs(args.pairs)
    if not firsts:
        raise ValueError(f"--pairs {args.pairs}: no pairs")
    PoolingParams(truncate_prompt_tokens=args.truncate_prompt_tokens)
    _check(args, engine_args)
    from vlax.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, runner=args.runner, **engine_args)
    t1 = time.perf_counter()
    outs = llm.score(
        firsts,
        seconds,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        use_tqdm=not args.no_progress,
    )
    _summary("score", len(outs), sum(len(o.prompt_token_ids) for o in outs), t0, t1)
    _write(({"index": i, "score": o.outputs.score} for i, o in enumerate(outs)), args.output)
    return 0
