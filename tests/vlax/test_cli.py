"""`vlax generate` end to end, in a subprocess, on the embedded default checkpoint."""

import json
import os
import subprocess
import sys


def test_generate_on_the_embedded_default(tmp_path):
    env = {**os.environ, "VLAX_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Hello"}) + "\n" + json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlax.cli",
            "generate",
            "--prompt",
            "The capital of France is",
            "--prompts",
            str(prompts),
            "--max-tokens",
            "5",
            "--output",
            str(out),
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stderr and "output tok/s" in r.stderr
    assert "attention backend: ragged_paged_attention -> reference" in r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == ["The capital of France is", "Hello", None]
    assert rows[2]["prompt_token_ids"] == [5, 6, 7]
    assert all(len(row["token_ids"]) == 5 and row["finish_reason"] == "length" for row in rows)


def test_bad_prompt_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    r = subprocess.run(
        [sys.executable, "-m", "vlax.cli", "generate", "--prompts", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "bad.jsonl:1: not valid JSON" in r.stderr
