"""`vlax.batch` on a local Ray cluster (2 CPUs): a 200-row job on 2 actors, one of whose processes
dies in the middle of the job, gives every row once, in input order, with the same completions as
`LLM.generate` on the same rows; `vlax batch` end to end; the errors, and the writer's guard."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

import vlax
from vlax import LLM, SamplingParams, cli, compilation_cache
from vlax.batch import CrashOnce, generate_rows
from vlax.batch import _table as output_table
from vlax.batch import _write as write_rows
from vlax.default_corpus import CORPUS
from vlax.default_model import default_model_path

ENGINE = dict(max_model_len=64, max_num_seqs=16)
MAX_TOKENS = 4
WORDS = CORPUS.split()  # prompts of 1-12 words from the tokenizer's own text


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(default_model_path(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def cluster():
    # The actors inherit this process's environment (JAX_PLATFORMS=cpu from conftest), and import
    # this checkout, as this process does, whatever an installed vlax points at. They share this
    # process's JAX compilation cache: the `llm` fixture compiles the same model's batch shapes
    # before any job starts, and compiling is most of an actor's start (measured: a first batch
    # 32 s to compile, 7 s from the cache, loaded; two actors compiling at once on 2 cores, with
    # another test process beside them, took 134 s).
    env = {
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "JAX_COMPILATION_CACHE_DIR": str(compilation_cache.enable()),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 << 20,
        runtime_env={"env_vars": env},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[str, list[dict]]:
    """200 rows: text prompts of 1-12 words, every fifth one given as token ids instead."""
    rows = []
    for i in range(200):
        text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 12))
        row = {"id": f"q{i:03d}"}
        if i % 5 == 4:
            row["prompt_token_ids"] = [1] + [3 + (i * 13 + k) % 800 for k in range(2 + i % 9)]
        else:
            row["prompt"] = text
        rows.append(row)
    path = tmp_path_factory.mktemp("input") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), rows


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def expected(llm, prompts) -> list[dict]:
    """What LLM.generate gives on the same rows, in one call, as the job's output rows."""
    rows = prompts[1]
    outs = llm.generate(
        [r.get("prompt") or {"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    return [
        {
            "id": r["id"],
            "prompt": o.prompt,
            "prompt_token_ids": o.prompt_token_ids,
            "texts": [c.text for c in o.outputs],
            "token_ids": [c.token_ids for c in o.outputs],
            "finish_reasons": [c.finish_reason for c in o.outputs],
        }
        for r, o in zip(rows, outs, strict=True)
    ]


def _written(path) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [
        {
            "id": r["id"],
            "prompt": r["prompt"],
            "prompt_token_ids": r["prompt_token_ids"],
            "texts": [c["text"] for c in r["outputs"]],
            "token_ids": [c["token_ids"] for c in r["outputs"]],
            "finish_reasons": [c["finish_reason"] for c in r["outputs"]],
        }
        for r in rows
    ]


def test_an_actor_killed_mid_job_loses_no_row_and_writes_none_twice(
    cluster, model, prompts, expected, tmp_path
):
    """The 200-row job on 2 actors, one of whose processes dies at its 7th batch (rows 96-111):
    every row once, in input order, each equal to LLM.generate on the same rows in one call."""
    marker = tmp_path / "crashed"
    result = vlax.batch(
        prompts[0],
        tmp_path / "out.jsonl",
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        model=model,
        num_actors=2,
        batch_size=16,
        use_tqdm=False,
        fault_injection=CrashOnce(row=101, marker=str(marker)),
        **ENGINE,
    )
    # The actor holding row 101's batch really ended: its process has exited (gone, or a zombie
    # its parent has not reaped yet), and the job went on without it.
    try:
        status = Path(f"/proc/{int(marker.read_text())}/status").read_text()
    except FileNotFoundError:
        status = "State:\tgone"
    assert "State:\tZ" in status or "State:\tgone" in status, status
    written = _written(tmp_path / "out.jsonl")
    assert [r["id"] for r in written] == [f"q{i:03d}" for i in range(200)]
    assert written == expected
    assert result.rows == 200 and not (tmp_path / "out.jsonl.partial").exists()
    assert result.output_tokens == sum(len(t) for r in expected for t in r["token_ids"])


def test_cli_job_writes_the_rows_in_input_order_as_llm_generate(
    cluster, model, prompts, expected, tmp_path, capsys
):
    """`vlax batch` end to end, on the first 32 rows as a parquet file, and one actor."""
    head = tmp_path / "head.parquet"
    columns = [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())),
    ]
    pq.write_table(pa.Table.from_pylist(prompts[1][:32], schema=pa.schema(columns)), head)
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "batch",
            "--model", model,
            "--input", str(head),
            "--output", str(out),
            "--batch-size", "16",
            "--max-tokens", str(MAX_TOKENS),
            "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    assert _written(out) == expected[:32]
    assert "vlax: 32 rows, " in capsys.readouterr().err


def test_bad_input_is_named_before_any_actor_starts(cluster, model, tmp_path):
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"id": 1, "text": "hello"}\n')
    with pytest.raises(
        ValueError,
        match=r"expected a 'prompt' or 'prompt_token_ids' column, "
        r"found \['id', 'text'\]",
    ):
        vlax.batch(no_prompt, tmp_path / "out.jsonl", model=model, use_tqdm=False)
    with pytest.raises(ValueError, match=r"input .*prompts\.csv.: expected a \.jsonl or \.parquet"):
        vlax.batch(tmp_path / "prompts.csv", tmp_path / "out.jsonl", model=model)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        vlax.batch(no_prompt, tmp_path / "out.jsonl", model=model, max_tokens=4)
    assert not (tmp_path / "out.jsonl").exists()


# A bad flag or input file exits with status 2 and one line naming it, before Ray or JAX is imported.
_CHECK_WITHOUT_RAY = (
    "import sys\n"
    "from vlax.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print(sorted({'jax', 'ray'} & set(sys.modules)))\n"
    "sys.exit(rc)\n"
)


def test_cli_argument_errors_exit_2_before_ray_starts(prompts, tmp_path):
    out = str(tmp_path / "out.jsonl")
    for args, message in [
        (["--input", str(tmp_path / "none.jsonl")], "none.jsonl': no such file"),
        (["--input", str(tmp_path / "p.csv")], "p.csv': expected a .jsonl or .parquet file"),
        (["--input", prompts[0], "--num-actors", "0"], "num_actors must be an int >= 1, got 0"),
        (["--input", prompts[0], "--tensor-parallel-size", "0"], "tensor_parallel_size must be"),
        (["--input", prompts[0], "--max-tokens", "0"], "max_tokens=0: expected an int >= 1"),
    ]:
        run = subprocess.run(
            [sys.executable, "-c", _CHECK_WITHOUT_RAY, "batch", "--output", out, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith("vlax batch: ") and message in run.stderr, run.stderr
        assert run.stdout.strip() == "[]"  # neither jax nor ray imported


def test_the_writer_refuses_a_row_delivered_twice_or_skipped(cluster, tmp_path):
    """The guard behind "no row written twice": were a retried batch delivered again (or a batch
    lost), the writer stops at the first row out of place, names it, and leaves no output."""

    def delivered(rows, error=None):
        lines = [json.dumps({"id": r}) for r in rows]
        return ray.data.from_arrow(
            output_table(rows, lines, [1] * len(rows), [2] * len(rows), error)
        )

    out = tmp_path / "out.jsonl"
    assert write_rows(delivered([0, 1, 2, 3]), 4, out, use_tqdm=False) == (4, 4, 8)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2, 3]
    out.unlink()
    with pytest.raises(
        RuntimeError, match="delivered input row 1 where row 2 was due: a duplicate"
    ):
        write_rows(delivered([0, 1, 1, 2]), 3, out, use_tqdm=False)
    with pytest.raises(RuntimeError, match=r"row 3 where row 2 was due: rows 2\.\.2 are missing"):
        write_rows(delivered([0, 1, 3, 4]), 5, out, use_tqdm=False)
    with pytest.raises(RuntimeError, match="the job ended after 3 of 4 rows"):
        write_rows(delivered([0, 1, 2]), 4, out, use_tqdm=False)
    with pytest.raises(
        ValueError, match=r"^input row 0: bad \(.*out.jsonl.partial holds the 0 rows"
    ):
        write_rows(delivered([0, 1], error="input row 0: bad"), 2, out, use_tqdm=False)
    assert not out.exists()


def test_a_batch_with_a_bad_row_names_the_row_instead_of_generating(llm):
    """What an actor hands back for a batch that LLM.generate refuses as a whole: the first bad
    row, by its position and id (generate's own message names its internal request id)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    good = [
        {"__vlax_row": 5, "id": "a", "prompt": "Hello"},
        {"__vlax_row": 6, "id": None, "prompt_token_ids": [1, 40, 41]},
    ]
    table = generate_rows(llm, params, good)
    assert table["error"].to_pylist() == [None, None]
    written = [json.loads(line) for line in table["line"].to_pylist()]
    reference = llm.generate(["Hello", {"prompt_token_ids": [1, 40, 41]}], params, use_tqdm=False)
    assert [r["id"] for r in written] == ["a", 6]  # no id: the row's position
    assert [r["outputs"][0]["token_ids"] for r in written] == [
        o.outputs[0].token_ids for o in reference
    ]
    for bad, message in [
        ({"id": "long", "prompt": "word " * 80}, "input row 7: request 'long': the prompt has"),
        ({"id": "none", "prompt": None}, "input row 7: id 'none' has no 'prompt' or 'prompt_tok"),
        (
            {"id": "v", "prompt_token_ids": [1, 5000]},
            "input row 7: request 'v': prompt token id 5000",
        ),
    ]:
        table = generate_rows(llm, params, [*good, {"__vlax_row": 7, **bad}])
        assert table["line"].to_pylist() == [None] * 3
        assert all(e.startswith(message) for e in table["error"].to_pylist()), table["error"]
