"""The embedded default checkpoint: deterministic bytes, loadable by transformers, atomic writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import vlax.default_model as dm

_WRITE = (
    "import sys; from pathlib import Path; from vlax.default_model import default_model_path; "
    "print(default_model_path(Path(sys.argv[1])))"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return dm.default_model_path(tmp_path_factory.mktemp("cache"))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_loadable_by_transformers(checkpoint):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(checkpoint)
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"] and 256 < len(tok) <= 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    ids = tok("Hello, café 🙂 world")["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, café 🙂 world"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user: hi\nassistant:"

    model = LlamaForCausalLM.from_pretrained(checkpoint)
    assert model.config.num_hidden_layers == 4 and model.config.num_key_value_heads == 2
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    assert logits.shape == (len(ids), len(tok)) and np.all(np.isfinite(logits))
    # random weights still give distinct greedy choices along the prompt, not one fixed token
    assert len(set(logits.argmax(-1).tolist())) > 1


def test_idempotent_and_leaves_no_temporary_dirs(checkpoint):
    before = {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()}
    assert dm.default_model_path(checkpoint.parent) == checkpoint
    assert {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()} == before
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name]


def test_concurrent_fresh_processes_write_identical_bytes(checkpoint, tmp_path):
    # Fresh processes have fresh hash seeds and thread pools, which is where nondeterminism hides;
    # two of them racing on one cache directory also exercises the atomic rename.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITE, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    paths = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert paths == {str(tmp_path / f"default-llama-{dm.DEFAULT_MODEL_VERSION}")}
    written = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir()] == [written.name]
    mine = _files(checkpoint)
    assert sorted(mine) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert _files(written) == mine


def test_losing_the_rename_race_keeps_the_winner(tmp_path, monkeypatch):
    final = tmp_path / f"default-llama-{dm.DEFAULT_MODEL_VERSION}"
    real_write = dm.write_default_model

    def write_while_another_process_wins(directory):
        final.mkdir()
        real_write(final)
        real_write(directory)

    monkeypatch.setattr(dm, "write_default_model", write_while_another_process_wins)
    assert dm.default_model_path(tmp_path) == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VLAX_CACHE_DIR", str(tmp_path))
    assert dm.cache_root() == tmp_path
    monkeypatch.delenv("VLAX_CACHE_DIR")
    assert dm.cache_root() == Path(os.path.expanduser("~")) / ".cache" / "vlax"
