"""Engine features on DeepSeek-V3 (one 'MLA latent' pool) and DeepSeek-V3.2 (the latent and the
'DSA indexer keys' pool): KV offload stores and loads every pool of a block (both families), and,
on V3.2 (the superset: the runner is family-blind), n > 1, sample and prompt logprobs (against
HF's full forward) and `vlax generate --model DIR`. HF parity of the tokens, chunked prefill,
prefix hits and preemption are tests/model/test_deepseek*_parity.py's.

Offload workload (as test_offload_end_to_end.py's, smaller): 6 distinct prompts of 24 tokens,
block_size 4, 4 greedy tokens, so a request fills (24 + 4 - 1) // 4 = 6 whole blocks, and a repeat
can load (24 - 1) // 4 = 5 of them. The device pool (15 usable blocks, 2 running requests of 7)
keeps at most the last two prompts, so running the prompts again in order loads every repeat from
the store. index_topk 6 < 24: V3.2's attention really selects, so its loaded indexer keys matter.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from model.testing import (
    DEEPSEEK_TINY,
    TINY_COMMON,
    hf_load,
    hf_logits,
    randomize_constant_parameters,
    randomize_routing_biases,
    write_tiny_checkpoint,
)
from runtime.core.request import SamplingParams
from runtime.offload.testing import check_store_then_load
from vlax import LLM

NUM_PROMPTS, PROMPT_LEN, BLOCK, MAX_TOKENS = 6, 24, 4, 4
FULL_BLOCKS = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK  # 6 stored per request
HIT_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # 5 loaded per repeated prompt
ENGINE = dict(max_model_len=32, block_size=BLOCK, max_num_seqs=2, record_steps=None)
NUM_KV_BLOCKS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# V3.2 on DEEPSEEK_TINY: eight index heads and no pad token (its zero embedding row makes every
# layer-0 index score 0), so index selections have no exact ties.
V32_TINY = {
    **TINY_COMMON,
    **DEEPSEEK_TINY,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 6,
    "pad_token_id": None,
}


def _write_v32(directory, seed) -> str:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**V32_TINY))
    randomize_constant_parameters(model, seed)
    randomize_routing_biases(model, seed)
    model.eval().save_pretrained(str(directory), safe_serialization=True)
    return str(directory)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """name -> (checkpoint, an engine without offload, its greedy tokens for PROMPTS), built once."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name) / "ckpt"
            if name == "deepseek_v3":
                path = write_tiny_checkpoint(directory, "deepseek_v3", seed=2)
            else:
                path = _write_v32(directory, seed=2)
            plain = LLM(path, dtype="float32", **ENGINE, num_kv_blocks=NUM_KV_BLOCKS)
            built[name] = (path, plain, tokens(plain, PROMPTS))
        return built[name]

    return get


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def family(request, build):
    return (request.param, *build(request.param))


PROMPTS = [
    {"prompt_token_ids": p}
    for p in np.random.default_rng(5).integers(3, 128, (NUM_PROMPTS, PROMPT_LEN)).tolist()
]


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_offload_stores_and_loads_every_pool(family):
    name, path, plain, baseline = family
    specs = plain.engine.runner.cache_specs
    pools = ["MLA latent"] + (["DSA indexer keys"] if name == "deepseek_v32" else [])
    assert [s.name for s in specs] == pools
    llm = LLM(
        path,
        dtype="float32",
        **ENGINE,
        num_kv_blocks=NUM_KV_BLOCKS,
        kv_offload="host",
        kv_offload_bytes=1 << 20,
    )
    try:
        # A stored block is its slice of every pool.
        assert llm.engine.offloader.store.block_nbytes == sum(s.bytes_per_block for s in specs)
        check_store_then_load(
            llm,
            lambda engine: tokens(engine, PROMPTS),
            baseline,
            stored=NUM_PROMPTS * FULL_BLOCKS,
            loaded=NUM_PROMPTS * HIT_BLOCKS,
            prefilled=NUM_PROMPTS * (PROMPT_LEN - HIT_BLOCKS * BLOCK),
        )
    finally:
        llm.engine.close()


def test_n_samples_share_the_prompt_and_are_seeded(build):
    _, plain, baseline = build("deepseek_v32")
    # Seeded samples: distinct, and the same again when the prompt's blocks come from the cache.
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True)
    a, b = (plain.generate(PROMPTS[:1], sp, use_tqdm=False)[0] for _ in range(2))
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def _greedy_kw():
    return dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_sample_and_prompt_logprobs_match_hf(build):
    """Logprobs of the sampled tokens and of the prompt's tokens against HF's log-softmax over one
    full forward (with its own sparse selection per query)."""
    path, plain, baseline = build("deepseek_v32")
    prompt = PROMPTS[1]["prompt_token_ids"]
    sp = SamplingParams(logprobs=3, prompt_logprobs=2, **_greedy_kw())
    out = plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == baseline[1]
    logits = hf_logits(hf_load(path), prompt + completion.token_ids)
    want = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    # Prompt logprobs: none for the first token, then each token's under the positions before it.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == PROMPT_LEN
    for i, position in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[i] in position
        _check_position(position, want[i - 1], top=2, token=prompt[i])
    for i, (token, position) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        assert position[token].rank == 1  # greedy
        _check_position(position, want[PROMPT_LEN - 1 + i], top=3, token=token)


def _check_position(position, row, *, top, token, atol=2e-3):
    """One position's logprobs against HF's row: every listed value, the listed top ones are HF's
    top ones (up to atol, for near-ties), and the token's rank (1 + how many are more likely)."""
    for t, lp in position.items():
        assert lp.logprob == pytest.approx(row[t], abs=atol), (t, lp.logprob, row[t])
    ranked = sorted((t for t in position if position[t].rank <= top), key=lambda t: -row[t])
    assert len(ranked) == top
    others = np.delete(row, ranked)
    assert row[ranked[-1]] >= others.max() - atol
    rank = position[token].rank
    assert (row > row[token] + atol).sum() <= rank - 1 <= (row > row[token] - atol).sum()


def test_cli_generates_with_a_deepseek_v32_checkpoint(build, tmp_path):
    """The CLI is family-blind: one run, on the family with two pools."""
    path, _, baseline = build("deepseek_v32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "out.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlax.cli",
            "generate",
            "--model",
            path,
            "--prompts",
            str(prompts),
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperature",
            "0",
            "--ignore-eos",
            "--logprobs",
            "1",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "32",
            "--output",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["prompt_token_ids"], row["index"]) for row in rows] == [
        (p["prompt_token_ids"], 0) for p in PROMPTS[:2]
    ]
    assert [row["token_ids"] for row in rows] == baseline[:2]
    for row in rows:
        assert row["finish_reason"] == "length" and len(row["logprobs"]) == MAX_TOKENS
