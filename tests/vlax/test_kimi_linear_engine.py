"""Kimi-Linear (KDA layers with recurrent state in slots, MLA layers, MoE) through the whole engine
against HF transformers (which runs its PyTorch reference KDA): greedy tokens identical and
logprobs close for a batch of prompts of different lengths, alone, with chunked prefill cutting
sequences inside blocks, and with a pool small enough to preempt; the regression scenario "request
preempted, its slot reused by another request, then re-admitted"; KDA forced to the Pallas kernels
(interpret mode); and the engine's refusals and logs for a model with recurrent state (KV offload
refused, prefix caching logged off, max_num_seqs beyond the state slots that fit refused).

One tiny checkpoint and its HF references are built once per module.
"""

import jax
import numpy as np
import pytest

from model import base
from model.config import ModelConfig
from model.testing import check_logprobs_close, hf_greedy, hf_load, hf_logits, write_tiny_checkpoint
from runtime.config import ConfigError
from runtime.core.request import SamplingParams
from runtime.runner.cache_budget import KVCacheSizeError
from runtime.runner.model_runner import model_cache_specs, model_options
from vlax import LLM

MAX_TOKENS = 10
BLOCK = 4
NUM_LOGPROBS = 5
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS
)
# Different lengths; a one-token prompt's first row is decode-shaped and must still start from a
# zeroed state.
BATCH_LENGTHS = (1, 6, 13, 22, 9, 30)
# The regression scenario's requests, as indices into the batch's prompts: A (9 tokens), F (6)
# and X (22) fill the pool as they decode; Y (1) arrives later.
SCENARIO = {"A": 4, "F": 1, "X": 3, "Y": 0}
# Every engine but the Pallas one has these shapes (3 sequences, 12 blocks of 4 per sequence, a
# 13-block pool, 16-token batches), so the step compiles once for all of them. 12 usable blocks
# cannot hold three of the longer sequences: requests get preempted.
NUM_KV_BLOCKS = 13
ENGINE = dict(
    max_model_len=48,
    block_size=BLOCK,
    max_num_seqs=3,
    num_kv_blocks=NUM_KV_BLOCKS,
    record_steps=None,
)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, n).tolist() for n in lengths]


def _hf_reference(model, prompt):
    """HF's greedy tokens and, at each, its top logprobs from one full forward."""
    tokens = hf_greedy(model, prompt, MAX_TOKENS)
    logits = hf_logits(model, prompt + tokens)[len(prompt) - 1 : -1]
    lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    top = np.argsort(-lp, axis=-1)[:, :NUM_LOGPROBS]
    return tokens, [{int(t): float(lp[i, t]) for t in top[i]} for i in range(len(tokens))]


def _ours(outputs):
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
        )
        for o in outputs
    ]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(checkpoint, prompts, their HF references)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("kimi") / "ckpt", "kimi_linear", seed=3)
    model = hf_load(path)
    prompts = _prompts(21, BATCH_LENGTHS)
    return path, prompts, [_hf_reference(model, p) for p in prompts]


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_batches_chunked_prefill_and_preemption_match_hf(kimi, logger_messages):
    path, prompts, reference = kimi
    with (
        logger_messages("runtime.engine_setup") as engine_log,
        logger_messages("runtime.runner.model_runner") as runner_log,
    ):
        chunked = LLM(path, dtype="float32", **ENGINE, max_num_batched_tokens=7)
    # One state slot per sequence that may run; the log line names the blocks and the slots.
    runner = chunked.engine.runner
    assert runner.num_state_slots == 3 and chunked.engine.state.config.num_state_slots == 3
    (line,) = [m for m in runner_log.records if m.startswith("KV cache:")]
    assert f"{NUM_KV_BLOCKS} blocks of {BLOCK} tokens and 3 state slots" in line
    # Prefix caching is off for a model with recurrent state, with one logged reason.
    (reason,) = [m for m in engine_log.records if "prefix caching" in m]
    assert reason.startswith("prefix caching is off for KimiLinearForCausalLM")
    assert not chunked.engine.state.config.enable_prefix_caching

    # The state pools sit in the cache value with one row per slot and the scratch row, and
    # the step takes (donates) them with the KV pools.
    specs = runner.cache_specs
    states = [
        entry
        for spec, entries in zip(specs, base.split_caches(specs, runner.kv_caches), strict=True)
        if isinstance(spec, base.StateCacheSpec)
        for entry in entries
    ]
    assert states and all(a.shape[0] == 4 for entry in states for a in entry)
    before = jax.tree_util.tree_leaves(runner.kv_caches)

    # Chunked prefill: a 7-token budget cuts prompts at positions inside blocks of 4, in steps
    # that also decode other requests; the state carries across the chunks.
    outputs = _generate(chunked, prompts)
    assert all(a.is_deleted() for a in before)
    assert [o.outputs[0].token_ids for o in outputs] == [r[0] for r in reference]
    check_logprobs_close(_ours(outputs), reference, atol=2e-3)
    prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outputs}
    chunk_starts = {
        cached.num_computed_tokens
        for so in chunked.engine.history
        for cached in so.scheduled_cached_reqs
        if cached.num_computed_tokens < prompt_len[cached.req_id]
    }
    assert any(c % BLOCK for c in chunk_starts), chunk_starts
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in chunked.engine.stats)

    # 16 tokens a step: the first batch holds three prompts of different lengths; the pool
    # cannot hold three of the longer sequences, so requests are preempted and recompute their
    # state.
    batched = LLM(path, dtype="float32", **ENGINE, max_num_batched_tokens=16)
    outputs = _generate(batched, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == [r[0] for r in reference]
    check_logprobs_close(_ours(outputs), reference, atol=2e-3)
    first = batched.engine.history[0].num_scheduled_tokens
    assert len(set(first.values())) == 3, first
    assert sum(s.num_preempted for s in batched.engine.stats) > 0


def test_preempted_request_slot_reused_then_readmitted_keeps_hf_tokens(kimi):
    """X (the least urgent) is preempted when A and F need blocks; Y, more urgent and waiting
    for a free sequence, is admitted into X's freed slot (a one-token prompt: its first row is
    decode-shaped); X is re-admitted later and rebuilds its state from token 0. Without the
    resets, Y would start from X's state, and X from what its slot held then."""
    path, batch, batch_reference = kimi
    prompts = {rid: batch[i] for rid, i in SCENARIO.items()}
    reference = {rid: batch_reference[i] for rid, i in SCENARIO.items()}
    llm = LLM(
        path, dtype="float32", **ENGINE, max_num_batched_tokens=16, scheduling_policy="priority"
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, priority in (("A", 0), ("F", 0), ("X", 1)):
        engine.add_request(rid, prompts[rid], params, priority=priority)
    finished = {}
    # Y arrives once the three run, so it waits for a sequence to free.
    while "X" not in engine.state.running:
        finished.update((o.request_id, o) for o in engine.step())
    engine.add_request("Y", prompts["Y"], params, priority=0)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    assert {rid: o.outputs[0].token_ids for rid, o in finished.items()} == {
        rid: ref[0] for rid, ref in reference.items()
    }

    history = engine.history
    preempted_at = next(i for i, so in enumerate(history) if "X" in so.preempted_req_ids)
    x_slot = history[preempted_at - 1].state_slots["X"]
    y_first = next(
        i for i, so in enumerate(history) if any(n.req_id == "Y" for n in so.scheduled_new_reqs)
    )
    assert y_first > preempted_at
    assert history[y_first].state_slots["Y"] == x_slot
    assert x_slot in history[y_first].reset_state_slots
    x_back, resumed = next(
        (i, cached)
        for i, so in enumerate(history)
        for cached in so.scheduled_cached_reqs
        if cached.req_id == "X" and cached.resumed_from_preemption
    )
    assert x_back > y_first and resumed.num_computed_tokens == 0
    assert history[x_back].state_slots["X"] in history[x_back].reset_state_slots


def test_kda_forced_to_pallas_gives_the_reference_tokens(kimi):
    path, prompts, reference = kimi
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        attention_backend="pallas",
    )
    backends = llm.engine.runner.backends
    assert backends["kda_prefill"].impl == "pallas" and backends["kda_prefill"].interpret
    assert backends["kda_decode"].impl == "pallas" and backends["kda_decode"].interpret
    picked = [1, 3]  # 6 and 22 tokens: the 22-token prompt is chunked (16-token budget)
    outputs = _generate(llm, [prompts[i] for i in picked])
    assert [o.outputs[0].token_ids for o in outputs] == [reference[i][0] for i in picked]
    check_logprobs_close(_ours(outputs), [reference[i] for i in picked], atol=2e-3)


def test_offload_and_too_many_sequences_are_refused_with_reasons(kimi):
    path = kimi[0]
    for offload in ("host", "mooncake"):
        with pytest.raises(
            ConfigError,
            match=(
                r"KimiLinearForCausalLM keeps per-request recurrent state \(.*\) in state slots, "
                rf"and KV offload moves only KV blocks.*kv_offload='{offload}' is refused"
            ),
        ):
            LLM(
                path,
                dtype="float32",
                max_model_len=64,
                block_size=BLOCK,
                kv_offload=offload,
                mooncake_master="127.0.0.1:1",
            )

    config = ModelConfig.from_pretrained(path, dtype="float32")
    specs = model_cache_specs(config, model_options(config, BLOCK, "auto"))
    per_slot = base.bytes_per_slot(specs)
    one_request = (64 // BLOCK + 1) * base.bytes_per_block(specs)
    budget = one_request + 5 * per_slot  # 4 slots and the scratch row
    with pytest.raises(KVCacheSizeError, match="holds only 4 state slots beside them: lower "):
        LLM(
            path,
            dtype="float32",
            max_model_len=64,
            block_size=BLOCK,
            max_num_seqs=8,
            kv_cache_bytes=budget,
        )
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        max_num_seqs=4,
        kv_cache_bytes=budget,
    )
    assert llm.engine.runner.num_state_slots == 4
    assert llm.engine.runner.state_cache_bytes == 5 * per_slot
