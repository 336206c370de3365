"""The `vlax` command line: `vlax generate ...`.

Every argument is checked before JAX is imported (the import alone takes seconds), so a typo costs a
fraction of a second. Every bad argument or input exits with status 2, argparse's convention.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from runtime.config import EngineConfig
from runtime.core.request import SamplingParams
from vlax import arguments, cli_pooling, engine_flags, logs
from vlax.completion_json import completion_json

_GENERATE_EPILOG = """\
output:
  Without --output, one line per completion on stdout:
      [prompt 0] 'Hello' -> ' world, and'
  Prompts count from 0 in the order given: the --prompt flags first, then the --prompts file.
  With --n above 1 each sample has its own line: [prompt 0, sample 1] ...
  Lines come in that order, each as soon as its prompt and every one before it have finished.
  With --output the completions go to the file instead, one JSON object a line, in the same order.
  The throughput summary goes to stderr, with the attention backend chosen when -v is given.

exit status: 0 done; 2 a bad argument or input, and nothing is generated (flags and files are
  checked before the engine starts).
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlax", description="vlax: offline LLM inference")
    sub = ap.add_subparsers(dest="command", required=True)
    cli_pooling.add_parsers(sub, _HelpFormatter)
    g = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions for prompts, as vLLM's LLM.generate does.",
        epilog=_GENERATE_EPILOG,
        formatter_class=_HelpFormatter,
    )
    g.add_argument(
        "--model",
        help="a local Hugging Face checkpoint folder (default: the embedded model, random weights: "
        "its text is gibberish, but it runs the whole engine; nothing is downloaded)",
    )
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for more)")
    g.add_argument(
        "--prompts",
        type=Path,
        help="a .txt file (one prompt a line) or .jsonl (objects with 'prompt' or "
        "'prompt_token_ids')",
    )
    g.add_argument(
        "--output", type=Path, help="write one JSON object per completion to this .jsonl file"
    )
    engine_flags.add_engine_flags(g)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="do not keep compiled steps in JAX's persistent compilation cache "
        "($VLAX_CACHE_DIR/jax, else ~/.cache/vlax/jax), which lets the next run of the same model "
        "skip compiling",
    )
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log INFO lines on stderr: the attention backend chosen and why, the KV cache size, "
        "batch shapes",
    )
    _add_sampling_flags(g)
    _add_batch_parser(sub)
    return ap


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """SamplingParams' flags, shared by the subcommands that generate."""
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32, help="most tokens per completion")
    s.add_argument(
        "--min-tokens", type=int, default=0, help="tokens before EOS or a stop may end a completion"
    )
    s.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 means greedy (always the most likely token); higher values sample more freely",
    )
    s.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the most likely tokens whose probabilities add up to P; 1 keeps all",
    )
    s.add_argument(
        "--top-k", type=int, default=0, help="sample from the K most likely tokens; 0 keeps all"
    )
    s.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than MIN_P times the most likely one; 0 keeps all",
    )
    s.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: lowers the logits of tokens already generated; 0 is off",
    )
    s.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: lowers logits by how often each token was generated; 0 is off",
    )
    s.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="above 1 discourages tokens already in the prompt or output; 1 is off",
    )
    s.add_argument(
        "--sample-seed",
        type=int,
        help="seed for each prompt's sampling: the same completions in any batch "
        "(default: drawn from --seed)",
    )
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a string that ends a completion, left out of its text (repeat for more)",
    )
    s.add_argument(
        "--ignore-eos", action="store_true", help="keep going past EOS, up to --max-tokens"
    )
    s.add_argument(
        "--logprobs",
        type=int,
        help="keep the top LOGPROBS log-probabilities of each output token (in --output)",
    )


_BATCH_EPILOG = """\
input:
  A .jsonl or .parquet file whose rows have 'prompt' (text) or 'prompt_token_ids' (a list of
  ints), and optionally 'id'; a row without an id gets its position, counted from 0.

output:
  One JSON object per input row, in input order: {"id", "prompt", "prompt_token_ids",
  "outputs": [{"index", "text", "token_ids", "finish_reason", "cumulative_logprob", "logprobs"}]}.
  Rows go to OUTPUT.partial as the job delivers them; it is renamed to OUTPUT once every row is
  written, so a failed job leaves OUTPUT.partial (the rows done, in order) and no OUTPUT.
  The progress bar counts rows written over the whole job; the summary goes to stderr.

ray:
  Without --ray-address (or RAY_ADDRESS) the job starts a local Ray cluster of this machine.
  An actor whose process dies is restarted and the batches it held run again.
  --model must be a folder every node can read; without it each node writes the embedded one.

exit status: 0 done; 2 a bad argument or input: flags and the input's columns are checked before
  any actor starts, and a row the engine refuses (no prompt, too long) stops the job when its turn
  comes, naming its position and id; 1 the job failed otherwise.
"""


def _add_batch_parser(sub) -> None:
    b = sub.add_parser(
        "batch",
        help="generate completions for a file of prompts on a Ray cluster",
        description="Generate a completion for every prompt of a file on a pool of Ray actors, "
        "each holding one LLM (Ray Data map_batches), and write them in input order.",
        epilog=_BATCH_EPILOG,
        formatter_class=_HelpFormatter,
    )
    b.add_argument(
        "--input", type=Path, required=True, help="the prompts: a .jsonl or .parquet file"
    )
    b.add_argument(
        "--output", type=Path, required=True, help="the .jsonl file to write, one row per prompt"
    )
    b.add_argument(
        "--model",
        help="a Hugging Face checkpoint folder every node can read (default: the embedded model, "
        "random weights)",
    )
    b.add_argument("--num-actors", type=int, default=1, help="actors, each holding one LLM")
    b.add_argument("--batch-size", type=int, default=64, help="prompts per map_batches call")
    b.add_argument("--num-cpus-per-actor", type=float, default=1.0, help="CPUs each actor reserves")
    b.add_argument(
        "--num-gpus-per-actor",
        type=float,
        default=0.0,
        help="GPUs each actor reserves (with --tensor-parallel-size T: T)",
    )
    b.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices each actor's LLM runs over (tensor parallelism)",
    )
    b.add_argument(
        "--ray-address", help="the Ray cluster to join (default: RAY_ADDRESS, else a local one)"
    )
    engine_flags.add_engine_flags(b)
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("-v", "--verbose", action="store_true", help="log vlax's INFO lines on stderr")
    _add_sampling_flags(b)


def _read_prompts(path: Path) -> list:
    if not path.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--prompts {path}: {e.strerror}") from None
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & item.keys()):
                raise ValueError(
                    f"{path}:{n}: expected an object with 'prompt' or 'prompt_token_ids'"
                )
            prompts.append(item)
        return prompts
    return [line for line in lines if line.strip()]


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(
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


def _label(prompt_index: int, sample_index: int, n: int) -> str:
    return (
        f"[prompt {prompt_index}]" if n == 1 else f"[prompt {prompt_index}, sample {sample_index}]"
    )


def _row(out, c) -> dict:
    completion = completion_json(c)
    # The request's fields around the completion's index, in the order the lines always had.
    return {
        "request_id": out.request_id,
        "index": completion.pop("index"),
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        **completion,
    }


def generate(args) -> int:
    # Everything a user typed is checked here, before the import of vlax.llm brings in JAX.
    prompts = list(args.prompt) + (_read_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts file")
    params = _sampling_params(args)
    engine_args = engine_flags.engine_args(args)
    EngineConfig(model=args.model or "", **engine_args)
    if args.model is not None:
        arguments.checkpoint_dir(args.model)
    if args.output is not None and not args.output.parent.is_dir():
        raise ValueError(f"--output {args.output}: folder {args.output.parent} does not exist")

    from tqdm.auto import tqdm

    from vlax.llm import LLM

    if args.model is None:
        print(
            "vlax: no --model given: using the embedded default checkpoint (RANDOM weights, "
            "so the text is gibberish; it shows the engine works).",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    llm = LLM(args.model, compilation_cache=not args.no_compilation_cache, **engine_args)
    t1 = time.perf_counter()
    sink = None if args.output is None else args.output.open("w")
    n_prompt = n_out = n_done = 0
    try:
        outputs = llm.generate_iter(prompts, params, use_tqdm=not args.no_progress)
        for i, out in enumerate(outputs):
            n_done += 1
            n_prompt += len(out.prompt_token_ids)
            for c in out.outputs:
                n_out += len(c.token_ids)
                if sink is not None:
                    sink.write(json.dumps(_row(out, c)) + "\n")
                    continue
                shown = repr(out.prompt) if out.prompt is not None else out.prompt_token_ids
                # tqdm.write keeps the progress bar (on stderr) below the printed lines.
                tqdm.write(f"{_label(i, c.index, args.n)} {shown} -> {c.text!r}", file=sys.stdout)
                sys.stdout.flush()
            if sink is not None:
                sink.flush()
    finally:
        if sink is not None:
            sink.close()
    t2 = time.perf_counter()
    gen_s = max(t2 - t1, 1e-9)
    prompts_done = f"{n_done} prompt" + ("" if n_done == 1 else "s")
    print(
        f"vlax: {prompts_done}, {n_prompt} prompt tokens, {n_out} output tokens in "
        f"{gen_s:.2f} s ({n_out / gen_s:.1f} output tok/s, {(n_prompt + n_out) / gen_s:.1f} total "
        f"tok/s); engine start-up {t1 - t0:.2f} s",
        file=sys.stderr,
    )
    return 0


def batch(args) -> int:
    # vlax.batch checks every argument and the input's columns before any actor starts; Ray and
    # JAX are imported after that.
    from vlax.batch import batch as run_job

    result = run_job(
        args.input,
        args.output,
        _sampling_params(args),
        model=args.model,
        num_actors=args.num_actors,
        batch_size=args.batch_size,
        num_cpus_per_actor=args.num_cpus_per_actor,
        num_gpus_per_actor=args.num_gpus_per_actor,
        ray_address=args.ray_address,
        use_tqdm=not args.no_progress,
        tensor_parallel_size=args.tensor_parallel_size,
        **engine_flags.engine_args(args),
    )
    seconds = max(result.seconds, 1e-9)
    print(
        f"vlax: {result.rows} rows, {result.prompt_tokens} prompt tokens, {result.output_tokens} "
        f"output tokens in {result.seconds:.2f} s ({result.output_tokens / seconds:.1f} output "
        f"tok/s, Ray start-up and model loading included); written to {args.output}",
        file=sys.stderr,
    )
    if args.model is None:
        print(
            "vlax: no --model was given: that was the embedded default checkpoint (RANDOM "
            "weights, so the text is gibberish; it shows the engine works).",
            file=sys.stderr,
        )
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)  # exits with status 2 on a malformed command line
    if args.command in cli_pooling.COMMANDS:
        return cli_pooling.main(args)
    if args.verbose:
        logs.set_level("INFO")
    command = {"generate": generate, "batch": batch}[args.command]
    try:
        return command(args)
    except (ValueError, TypeError) as e:
        print(f"vlax {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vlax {args.command}: interrupted", file=sys.stderr)
        return 130  # the shell's code for a SIGINT


if __name__ == "__main__":
    sys.exit(main())
