"""`vlax.batch`: a data-parallel generation job over a Ray cluster.

Ray Data reads the prompts (a .jsonl or .parquet file) and runs `map_batches` over a fixed pool of
actors, each holding one `LLM`. The driver receives the outputs in input order (Ray Data's
`preserve_order`) and is the only writer of the output file, so the file is in input order and
every row is written by one process, once.

Exactly once, by construction: before the job, every input row gets its position (0, 1, ...) and
the position travels through the job with the row. The writer takes row N only when it expects
row N, and fails the job naming the row if anything else arrives. A failed actor (a crashed or
killed process) loses only the batches it had not delivered: Ray restarts the actor and runs
those batches again (Ray Data's actor fault tolerance, without a limit on tries); the driver
never saw their outputs, so nothing is written twice.

The output goes to OUTPUT.partial while the job runs and is renamed to OUTPUT when every row is
written: a job that fails leaves OUTPUT.partial with the rows done before the failure, in order,
and no OUTPUT.

Nothing here imports Ray or JAX at import time: `vlax` imports this module for `vlax.batch`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from runtime.config import ConfigError, EngineConfig
from runtime.core.request import SamplingParams
from vlax import arguments
from vlax.completion_json import completion_json

INPUT_SUFFIXES = (".jsonl", ".parquet")
PROMPT_COLUMNS = ("prompt", "prompt_token_ids")
_ROW = "__vlax_row"  # the input position of a row, carried through the job


@dataclass(frozen=True)
class BatchResult:
    """What a finished job did: rows written, their prompt and output tokens, and its time."""

    rows: int
    prompt_tokens: int
    output_tokens: int
    seconds: float


@dataclass(frozen=True)
class CrashOnce:
    """Fault injection, for drills and tests: the actor that has generated the batch holding input
    row `row` ends its own process with os._exit (as a crash or an out-of-memory kill would) before
    it hands the batch back. `marker` is a file path every actor can see; the first actor to
    create it crashes, so the crash happens once per job and the retried batch goes through."""

    row: int
    marker: str

    def strike(self, rows: list[int]) -> None:
        if self.row not in rows:
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # crashed on this batch before: this is the retry
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        os._exit(70)


def batch(
    input: str | os.PathLike,
    output: str | os.PathLike,
    sampling_params: SamplingParams | None = None,
    *,
    model: str | None = None,
    num_actors: int = 1,
    batch_size: int = 64,
    num_cpus_per_actor: float = 1,
    num_gpus_per_actor: float = 0,
    ray_address: str | None = None,
    use_tqdm: bool = True,
    fault_injection: CrashOnce | None = None,
    **engine_args,
) -> BatchResult:
    """Generate a completion for every prompt of `input` on `num_actors` actors, each holding one
    `LLM(model, **engine_args)`, and write one JSON object per prompt to `output` (.jsonl), in
    input order.

    `input` is a .jsonl or .parquet file whose rows have `prompt` (text) or `prompt_token_ids`
    (a list of ints), and optionally `id` (kept in the output; without it a row's id is its
    position, counted from 0). Each output row is `{"id", "prompt", "prompt_token_ids",
    "outputs": [{"index", "text", "token_ids", "finish_reason", "cumulative_logprob",
    "logprobs"}]}`. `sampling_params` (default: the checkpoint's defaults, as `LLM.generate`)
    applies to every prompt. A row that `LLM.generate` refuses (no prompt, too long for
    max_model_len) stops the job with a ValueError naming its position and id, once the rows
    before its batch are written (to OUTPUT.partial, which a failed job leaves behind).

    Ray: a running Ray session is used as it is; otherwise `ray.init(address=ray_address)`
    connects to a cluster (None: RAY_ADDRESS, else a new local one) and is shut down at the end.
    Each actor reserves `num_cpus_per_actor` CPUs and `num_gpus_per_actor` GPUs (for an actor
    that is a tensor-parallel group, its group size). `model` must be a path every node can
    read; None is the embedded default checkpoint, which each node writes for itself.
    """
    started = time.perf_counter()
    input_path, output_path = _check_paths(input, output)
    _check_job(model, engine_args, sampling_params, num_actors, batch_size)

    import ray

    own_session = not ray.is_initialized()
    if own_session:
        ray.init(address=ray_address)
    try:
        counts = _run(
            input_path,
            output_path,
            sampling_params,
            model=model,
            engine_args=engine_args,
            num_actors=num_actors,
            batch_size=batch_size,
            num_cpus_per_actor=num_cpus_per_actor,
            num_gpus_per_actor=num_gpus_per_actor,
            use_tqdm=use_tqdm,
            fault_injection=fault_injection,
        )
    finally:
        if own_session:
            ray.shutdown()
    return BatchResult(*counts, seconds=time.perf_counter() - started)


def _check_paths(input, output) -> tuple[Path, Path]:
    input_path, output_path = Path(input), Path(output)
    if input_path.suffix not in INPUT_SUFFIXES:
        raise ValueError(
            f"input {str(input_path)!r}: expected a {' or '.join(INPUT_SUFFIXES)} file"
        )
    if not input_path.is_file():
        raise ValueError(f"input {str(input_path)!r}: no such file")
    if output_path.suffix != ".jsonl":
        raise ValueError(f"output {str(output_path)!r}: expected a .jsonl file")
    if not output_path.parent.is_dir():
        raise ValueError(
            f"output {str(output_path)!r}: folder {str(output_path.parent)!r} does not exist"
        )
    return input_path, output_path


def _check_job(model, engine_args, sampling_params, num_actors, batch_size) -> None:
    """Everything that can be checked before Ray starts, each error naming the bad value."""
    accepted = [f.name for f in fields(EngineConfig) if f.name != "model"]
    arguments.check_keywords("vlax.batch()", engine_args, accepted)
    EngineConfig(model=model or "", **engine_args)
    if model is not None:
        arguments.checkpoint_dir(model)
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params must be a SamplingParams or None, got {sampling_params!r}"
        )
    _at_least("num_actors", num_actors, 1)
    _at_least("batch_size", batch_size, 1)


def _at_least(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")


def _run(input_path, output_path, sampling_params, *, use_tqdm, **job) -> tuple[int, int, int]:
    import ray

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    # A dataset keeps a copy of the context current when it is made: these settings hold for
    # this job's datasets, and the caller's context is put back as it was.
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = not use_tqdm  # our bar counts rows over the whole job instead
    try:
        prompts, total = _numbered(input_path, job["batch_size"])
        outputs = _generated(prompts, sampling_params, **job)
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
    return _write(outputs, total, output_path, use_tqdm)


def _numbered(path: Path, batch_size: int):
    """The input's rows, each with its position in column _ROW, as a dataset of one block per
    batch (one block is one actor call: the actors share the work, and a dead actor's batches
    are all that is run again), and the number of rows.

    Ray Data's read tasks parse the file; the positions are given here, on the driver, as the
    rows arrive in input order (the outputs come back through the driver the same way).
    """
    import pyarrow as pa
    import ray

    # read_json reads line-delimited JSON with pyarrow's reader (token ids as list<int64>).
    read = ray.data.read_parquet if path.suffix == ".parquet" else ray.data.read_json
    ds = read(str(path))
    blocks, total = [], 0
    for table in ds.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
        if not set(PROMPT_COLUMNS) & set(table.column_names):
            raise ValueError(
                f"input {str(path)!r}: expected a 'prompt' or 'prompt_token_ids' column, "
                f"found {sorted(table.column_names)}"
            )
        positions = pa.array(range(total, total + table.num_rows), pa.int64())
        blocks.append(table.append_column(_ROW, positions))
        total += table.num_rows
    if total == 0:
        raise ValueError(f"input {str(path)!r} has no rows")
    return ray.data.from_arrow(blocks), total


def _generated(
    prompts,
    sampling_params,
    *,
    model,
    engine_args,
    num_actors,
    batch_size,
    num_cpus_per_actor,
    num_gpus_per_actor,
    fault_injection,
):
    import ray

    return prompts.map_batches(
        _Generator,
        fn_constructor_kwargs=dict(
            model=model,
            engine_args=engine_args,
            sampling_params=sampling_params,
            fault_injection=fault_injection,
        ),
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_cpus=num_cpus_per_actor,
        num_gpus=num_gpus_per_actor,
        # Ray Data restarts an actor whose process dies and reruns the batches it held (its
        # defaults: max_restarts and max_task_retries -1, no limit); an exception raised by
        # this code is not retried, it fails the job.
    )


def _write(outputs, total: int, path: Path, use_tqdm: bool) -> tuple[int, int, int]:
    """Writes the rows as they arrive, each only when it is the one due; returns the rows, prompt
    tokens and output tokens written."""
    from tqdm.auto import tqdm

    partial = path.with_name(path.name + ".partial")
    due = prompt_tokens = output_tokens = 0  # `due`: the position of the next row to write
    with (
        partial.open("w") as sink,
        tqdm(total=total, desc="Batch rows", unit="row", disable=not use_tqdm) as bar,
    ):
        for part in outputs.iter_batches(batch_size=None, batch_format="pyarrow"):
            rows = part[_ROW].to_pylist()
            lines, errors = part["line"].to_pylist(), part["error"].to_pylist()
            for row, line, error in zip(rows, lines, errors, strict=True):
                if row != due:
                    raise RuntimeError(
                        f"the job delivered input row {row} where row {due} was due: "
                        f"{'a duplicate' if row < due else f'rows {due}..{row - 1} are missing'}"
                        f"; {partial} holds the {due} rows before it"
                    )
                if error is not None:
                    raise ValueError(f"{error} ({partial} holds the {due} rows before it)")
                sink.write(line + "\n")
                due += 1
            sink.flush()
            prompt_tokens += sum(part["prompt_tokens"].to_pylist())
            output_tokens += sum(part["output_tokens"].to_pylist())
            bar.update(len(rows))
    if due != total:
        raise RuntimeError(f"the job ended after {due} of {total} rows; {partial} holds them")
    os.replace(partial, path)
    return due, prompt_tokens, output_tokens


class _Generator:
    """One actor of the pool: one LLM, called on one batch of rows at a time."""

    def __init__(self, *, model, engine_args, sampling_params, fault_injection) -> None:
        from vlax.llm import LLM

        self.llm = LLM(model, **engine_args)
        if sampling_params is None:
            sampling_params = self.llm.get_default_sampling_params()
        self.params = sampling_params
        self.fault_injection = fault_injection

    def __call__(self, table):
        records = table.to_pylist()
        out = generate_rows(self.llm, self.params, records)
        if self.fault_injection is not None:
            self.fault_injection.strike([r[_ROW] for r in records])
        return out


def generate_rows(llm, params: SamplingParams, records: list[dict]):
    """One batch's output table: per row its position, JSON line and token counts. A batch with a
    bad row (no prompt, too long, an id outside the vocabulary...) is not generated: every row
    carries the error instead, naming the first bad row, and the writer raises it when the
    batch's turn comes, so the rows before it are written and the message reaches the caller as
    a ValueError (raised here, Ray would hand the driver a traceback in a UserCodeException)."""
    rows = [r[_ROW] for r in records]
    try:
        outs = llm.generate([_prompt(r) for r in records], params, use_tqdm=False)
    except (ValueError, TypeError) as err:
        error = _first_bad_row(llm, params, records) or str(err)
        return _table(rows, [None] * len(rows), [0] * len(rows), [0] * len(rows), error)
    return _table(
        rows,
        [json.dumps(_record(r, out)) for r, out in zip(records, outs, strict=True)],
        [len(o.prompt_token_ids) for o in outs],
        [sum(len(c.token_ids) for c in o.outputs) for o in outs],
        None,
    )


def _table(rows, lines, prompt_tokens, output_tokens, error: str | None):
    import pyarrow as pa

    return pa.table(
        {
            _ROW: pa.array(rows, pa.int64()),
            "line": pa.array(lines, pa.string()),
            "prompt_tokens": pa.array(prompt_tokens, pa.int64()),
            "output_tokens": pa.array(output_tokens, pa.int64()),
            "error": pa.array([error] * len(rows), pa.string()),
        }
    )


def _first_bad_row(llm, params, records) -> str | None:
    """generate's error names its own request id; the user needs the input row. The rows are
    checked one at a time (each check changes nothing) to find the first bad one."""
    processor = llm.engine.input_processor
    for record in records:
        try:
            text, ids = processor.prompt_inputs(_prompt(record))
            processor.process(str(_id(record)), ids, params, prompt=text)
        except (ValueError, TypeError) as err:
            return f"input row {record[_ROW]}: {err}"
    return None


def _prompt(record: Mapping) -> str | dict:
    """A row as a prompt `LLM.generate` takes; a row with neither column is named."""
    ids, text = record.get("prompt_token_ids"), record.get("prompt")
    if ids is not None:
        return (
            {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
        )
    if text is not None:
        return text
    raise ValueError(f"id {_id(record)!r} has no 'prompt' or 'prompt_token_ids'")


def _id(record: Mapping) -> object:
    return record[_ROW] if record.get("id") is None else record["id"]


def _record(record: Mapping, out) -> dict:
    return {
        "id": _id(record),
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "outputs": [completion_json(c) for c in out.outputs],
    }
