"""LLM.generate against HF transformers: identical greedy tokens, close logprobs, through the whole
engine (scheduler, paged KV cache, prefix cache, chunked prefill, preemption, sampler)."""

import numpy as np
import pytest

from model.testing import (
    check_logprobs_close,
    hf_greedy,
    hf_load,
    hf_logits,
    write_tiny_checkpoint,
)
from runtime.runner import cpu_bf16
from vlax import LLM, SamplingParams

MAX_TOKENS = 10


def _prompts(seed: int, lengths, vocab: int = 128, prefix_len: int = 0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, prefix_len).tolist()
    return [prefix + rng.integers(3, vocab, n).tolist() for n in lengths]


def _hf_reference(path, prompts, num_logprobs=5):
    model = hf_load(path)
    out = []
    for p in prompts:
        toks = hf_greedy(model, p, MAX_TOKENS)
        logits = hf_logits(model, p + toks)[len(p) - 1 : -1]
        lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        top = np.argsort(-lp, axis=-1)[:, :num_logprobs]
        out.append((toks, [{int(t): float(lp[i, t]) for t in top[i]} for i in range(len(toks))]))
    return out


def _ours(outs):
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]))
    return res


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "llama": write_tiny_checkpoint(root / "llama", "llama", seed=1),
        "qwen2": write_tiny_checkpoint(
            root / "qwen2", "qwen2", seed=2, num_key_value_heads=1, tie_word_embeddings=True
        ),
        "qwen3": write_tiny_checkpoint(root / "qwen3", "qwen3", seed=3, num_key_value_heads=4),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_and_logprobs_match_hf_with_chunked_prefill(checkpoints, arch):
    path = checkpoints[arch]
    prompts = _prompts(10, [3, 17, 40, 9, 1])
    # A 16-token budget chunks the 17- and 40-token prompts over several steps, mixed with decodes.
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        record_steps=None,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ref = _hf_reference(path, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref]
    check_logprobs_close(_ours(outs), ref, atol=2e-3)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.stats)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_prefix_hits_preemption_and_no_chunking_keep_hf_tokens(checkpoints):
    path = checkpoints["llama"]
    prompts = _prompts(11, [5, 9, 13, 2, 21, 7], prefix_len=24)
    # 16 usable blocks of 4 tokens cannot hold six ~35-token sequences: requests get preempted.
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=6,
        block_size=4,
        num_kv_blocks=17,
        enable_chunked_prefill=False,
        record_steps=None,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ref = _hf_reference(path, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref]
    check_logprobs_close(_ours(outs), ref, atol=2e-3)
    engine = llm.engine
    assert sum(s.num_preempted for s in engine.stats) > 0
    hits = [nd.num_computed_tokens for so in engine.history for nd in so.scheduled_new_reqs]
    assert max(hits) >= 24  # the shared prefix came from the cache


def test_pallas_attention_backend_matches_hf(checkpoints):
    path = checkpoints["qwen3"]
    prompts = _prompts(12, [6, 19])
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=8,
        attention_backend="pallas",
    )
    assert llm.engine.runner.backends["ragged_paged_attention"].impl == "pallas"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ref = _hf_reference(path, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in ref]
    check_logprobs_close(_ours(outs), ref, atol=2e-3)


def test_bf16_f32_kv_cache_on_cpu_gives_the_bf16_cache_tokens(tmp_path, monkeypatch):
    """On the CPU a bf16 model keeps an f32 KV cache where the C++ kernels do not serve (bf16
    keys/values are exact in f32), a bf16 one where they do (runner/cpu_bf16.py): both give the
    same tokens and logprobs as the Pallas path, which keeps the cache in bf16."""
    path = write_tiny_checkpoint(tmp_path / "bf16", "llama", seed=4, dtype="bfloat16")
    prompts = [{"prompt_token_ids": p} for p in _prompts(13, [5, 11])]
    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})
    runs = []
    for backend, kernels in (("reference", False), ("reference", True), ("pallas", True)):
        choice = cpu_bf16.choose(flags, native_kernels=kernels)
        monkeypatch.setattr(cpu_bf16, "host_choice", lambda head_dim, choice=choice: choice)
        llm = LLM(
            path,
            max_model_len=64,
            max_num_seqs=2,
            block_size=8,
            attention_backend=backend,
        )
        kv_dtype = llm.engine.runner.kv_caches[0][0].dtype.name
        runs.append((kv_dtype, _ours(llm.generate(prompts, GREEDY, use_tqdm=False))))
    (dt_f32, f32), (dt_bf16, bf16), (dt_pallas, pallas) = runs
    assert (dt_f32, dt_bf16, dt_pallas) == ("float32", "bfloat16", "bfloat16")
    assert [r[0] for r in f32] == [r[0] for r in bf16] == [p[0] for p in pallas]
    check_logprobs_close(f32, bf16, atol=1e-6)  # the same values in either cache
    check_logprobs_close(f32, pallas, atol=5e-2)  # bf16 dots in the kernel
