"""`vlax generate` as a newcomer meets it: --help, argument errors, and runs end to end in a
subprocess on the embedded default checkpoint."""

import json
import os
import re
import subprocess
import sys

import pytest

from vlax import cli


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "VLAX_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}


def _generate(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "vlax.cli", "generate", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_help_shows_the_defaults_and_explains_the_output(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option, whatever the terminal
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "most tokens per completion (default: 32)" in text
    assert "0 means greedy (always the most likely token)" in text
    for flag, default in [
        ("--max-num-seqs", "256 per device"),
        ("--block-size", 16),
        ("--dtype", "auto"),
        ("--top-p", 1.0),
        ("--top-k", 0),
        ("--n", 1),
        ("--seed", 0),
    ]:
        # An option's block runs from its flag to the next option; long ones wrap once.
        block = next(b for b in re.split(r"\n(?=  -)", text) if b.strip().startswith(flag + " "))
        assert " ".join(block.split()).endswith(f"(default: {default})"), block
    assert "[prompt 0] 'Hello' -> " in text and "[prompt 0, sample 1]" in text
    assert "(default: None)" not in text and "(default: False)" not in text


# Each is a plain argument error: exit status 2, a message naming the bad value, and no JAX import
# (it took 7-12 s before the message came).
_CHECK_WITHOUT_JAX = (
    "import sys\n"
    "from vlax.cli import main\n"
    "try:\n"
    "    rc = main(sys.argv[1:])\n"
    "except SystemExit as e:\n"
    "    rc = e.code\n"
    "print('jax imported' if 'jax' in sys.modules else 'no jax')\n"
    "sys.exit(rc)\n"
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "{tmp}/absent.txt"], "--prompts {tmp}/absent.txt: no such file"),
        (["--prompts", "{tmp}/bad.jsonl"], "bad.jsonl:1: not valid JSON"),
        ([], "give at least one --prompt or a --prompts file"),
        (["--prompt", "x", "--temperature", "-1"], "temperature=-1.0: expected a float in [0, 2]"),
        (["--prompt", "x", "--max-tokens", "0"], "max_tokens=0: expected an int >= 1"),
        (["--prompt", "x", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
        (["--prompt", "x", "--block-size", "12"], "block_size must be a power of two, got 12"),
        (["--prompt", "x", "--max-logprobs", "-2"], "max_logprobs must be an int >= 0, or -1"),
        (["--prompt", "x", "--model", "{tmp}/absent"], "model '{tmp}/absent' does not exist"),
        (["--prompt", "x", "--output", "{tmp}/no/out.jsonl"], "folder {tmp}/no does not exist"),
        (["--prompt", "x", "--max-tokens", "many"], "invalid int value: 'many'"),
        (["--prompt", "x", "--dtype", "float64"], "invalid choice: 'float64'"),
    ],
)
def test_argument_error_exits_2_before_jax_is_imported(tmp_path, args, message):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    args = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run(
        [sys.executable, "-c", _CHECK_WITHOUT_JAX, "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert message.format(tmp=tmp_path) in r.stderr
    assert r.stdout.strip() == "no jax"


def test_generate_prints_labelled_lines_and_is_quiet(env, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n\nOnce upon a time\n")
    r = _generate(
        env, "--prompt", "The capital of France is", "--prompts", str(prompts), "--max-tokens", "3"
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(" -> ")[0] for line in lines] == [
        "[prompt 0] 'The capital of France is'",
        "[prompt 1] 'Hello'",
        "[prompt 2] 'Once upon a time'",
    ]
    assert "RANDOM weights" in r.stderr and "3 prompts" in r.stderr
    assert "INFO" not in r.stderr  # the backend choice is said at -v only


def test_generate_to_a_file_with_verbose_logging(env, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Hello"}) + "\n" + json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    r = _generate(
        env,
        "--prompt",
        "The capital of France is",
        "--prompts",
        str(prompts),
        "--max-tokens",
        "5",
        "--n",
        "2",
        "--temperature",
        "0.8",
        "--sample-seed",
        "1",
        "--ignore-eos",
        "--logprobs",
        "2",
        "--output",
        str(out),
        "--no-progress",
        "-v",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert "output tok/s" in r.stderr
    assert "INFO" in r.stderr and "ragged_paged_attention -> reference" in r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["prompt"], row["index"]) for row in rows] == [
        ("The capital of France is", 0),
        ("The capital of France is", 1),
        ("Hello", 0),
        ("Hello", 1),
        (None, 0),
        (None, 1),
    ]
    assert rows[4]["prompt_token_ids"] == [5, 6, 7]
    for row in rows:
        assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length"
        assert len(row["logprobs"]) == 5
        sampled = [position[0]["token_id"] for position in row["logprobs"]]
        assert sampled == row["token_ids"]
