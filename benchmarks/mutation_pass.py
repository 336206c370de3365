"""Mutation pass: plausible one-line bugs, each run against the tests that exist for its code.

A mutant is killed when its test subset fails (or times out) and survives when the subset passes.
Every survivor is either a gap in the tests or an equivalent mutant (one that cannot change what
the code computes); `MUTANTS` says which test kills each, or why it is equivalent.

The pass edits source files while it runs, so it refuses to run in the primary checkout: run it
in a separate git worktree, from the repository it lives in:

    git worktree add /tmp/mutants HEAD
    cd /tmp/mutants && python benchmarks/mutation_pass.py [--only NAME ...] [--json]

The worktree's own code is what the tests import (pytest is started from its root, first on
sys.path); the pass checks that before it starts. Each file is restored byte for byte after its
mutant, and `--check` only verifies that every mutant's original line is still in the code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CORE = ("tests/runtime/core",)
SAMPLER = ("tests/runtime/runner/test_sampler.py", "tests/runtime/runner/test_sampler_edges.py")
INPUTS = ("tests/runtime/runner", "tests/vlax/test_generate_hf_parity.py")
MODEL = ("tests/model",)
RPA = (
    "tests/pallas_kernels/test_ragged_paged_attention_reference.py",
    "tests/pallas_kernels/test_ragged_paged_attention.py",
)
FLASH = ("tests/pallas_kernels/test_flash_attention.py",)
KDA = ("tests/pallas_kernels/test_kda_reference.py", "tests/pallas_kernels/test_kda_decode.py")
MLA = ("tests/pallas_kernels/test_sparse_mla_decode.py",)


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    file: str
    original: str  # one whole source line, without its indentation
    mutated: str
    tests: tuple[str, ...]


def _m(name, file, original, mutated, tests):
    return Mutant(name, file, original, mutated, tests)


BH, BP, KVC = (
    "runtime/core/kv/block_hash.py",
    "runtime/core/kv/block_pool.py",
    "runtime/core/kv/kv_cache.py",
)
SS, ES = "runtime/core/scheduling/plan_step.py", "runtime/core/scheduling/encoder_scheduling.py"
EC, KJ = "runtime/core/encoder/encoder_cache.py", "runtime/core/kv_jobs/jobs.py"
UP, STOP = "runtime/core/scheduling/apply_output.py", "runtime/core/scheduling/stop.py"
SST = "runtime/core/scheduling/scheduler_state.py"
SMP, SMD = "runtime/runner/sampler.py", "runtime/runner/sampling_metadata.py"
INP = "runtime/runner/inputs.py"
LLAMA, NORM, ROPE = "model/llama.py", "model/layers/norms.py", "model/layers/rotary.py"
ATTN, MLP, LIN = "model/layers/attention.py", "model/layers/mlp.py", "model/layers/linear.py"
RPA_REF = "pallas_kernels/ragged_paged_attention/reference.py"
FLASH_REF = "pallas_kernels/flash_attention/reference.py"
KDA_REF = "pallas_kernels/kda/reference.py"
MLA_REF = "pallas_kernels/sparse_mla_decode/reference.py"

MUTANTS: tuple[Mutant, ...] = (
    # ---- core: block hashes
    _m(
        "hash_span_ending_at_block_start_keys_it",
        BH,
        "first_span = bisect_right(span_ends, start)",
        "first_span = bisect_right(span_ends, start - 1)",
        CORE,
    ),
    _m(
        "hash_span_starting_at_next_block_keys_this_one",
        BH,
        "if offset >= start + block_size:",
        "if offset > start + block_size:",
        CORE,
    ),
    _m("hash_salt_on_every_block", BH, "if index == 0:", "if index >= 0:", CORE),
    _m(
        "hash_ignores_span_offset",
        BH,
        "digest.update(_I64.pack(offset))",
        "pass",
        CORE,
    ),
    # ---- core: block pool
    _m(
        "pool_cached_run_ignores_limit",
        BP,
        "for position in range(min(limit, len(block_hashes))):",
        "for position in range(len(block_hashes)):",
        CORE,
    ),
    _m("pool_double_free_refrees", BP, "if count == 1:", "if count <= 1:", CORE),
    _m("pool_touch_keeps_num_free", BP, "num_free -= 1", "num_free -= 0", CORE),
    _m(
        "pool_fresh_range_off_by_one",
        BP,
        "num_fresh = min(n - len(taken), pool.num_blocks - pool.next_fresh)",
        "num_fresh = min(n - len(taken), pool.num_blocks - pool.next_fresh - 1)",
        CORE,
    ),
    _m(
        "pool_evicting_last_duplicate_drops_first_holder",
        BP,
        "if block in dup or index[block_hash] != block:",
        "if block in dup:",
        CORE,
    ),
    # ---- core: kv cache
    _m(
        "kv_full_prompt_hit_leaves_nothing_to_compute",
        KVC,
        "state.pool, request.block_hashes, (num_tokens - 1) // state.pool.block_size",
        "state.pool, request.block_hashes, num_tokens // state.pool.block_size",
        CORE,
    ),
    _m(
        "kv_free_head_first",
        KVC,
        "bp.release(state.pool, reversed(table)),",
        "bp.release(state.pool, table),",
        CORE,
    ),
    _m(
        "kv_revived_blocks_not_counted",
        KVC,
        "num_revived = sum(1 for block in cached_blocks if bp.is_free(pool, block))",
        "num_revived = 0",
        CORE,
    ),
    _m(
        "kv_lookahead_not_capped",
        KVC,
        "slots = min(filled + lookahead, state.max_model_len)",
        "slots = filled + lookahead",
        CORE,
    ),
    _m(
        "kv_caches_partial_block",
        KVC,
        "num_full = max(num_cached, min(filled // block_size, len(block_hashes)))",
        "num_full = max(num_cached, min(-(-filled // block_size), len(block_hashes)))",
        CORE,
    ),
    _m(
        "kv_max_model_len_off_by_one",
        KVC,
        "if filled > state.max_model_len:",
        "if filled >= state.max_model_len:",
        CORE,
    ),
    # ---- core: scheduler
    _m("sched_fcfs_preempts_first", SS, "return len(step.running) - 1", "return 0", CORE),
    _m(
        "sched_priority_preempts_most_urgent",
        SS,
        "return keys.index(max(keys))",
        "return keys.index(min(keys))",
        CORE,
    ),
    _m(
        "sched_long_prefill_cap_never_lifted",
        SS,
        "many = len(state.running) + len(state.waiting) + len(holding) > 1",
        "many = len(state.running) + len(state.waiting) + len(holding) >= 1",
        CORE,
    ),
    _m(
        "sched_no_chunking_budget_boundary",
        SS,
        "if not config.enable_chunked_prefill and num_new > step.token_budget:",
        "if not config.enable_chunked_prefill and num_new >= step.token_budget:",
        CORE,
    ),
    _m("sched_admits_after_preempting", SS, "if not step.preempted:", "if True:", CORE),
    _m(
        "sched_reservation_ignores_revived_blocks",
        SS,
        "revived = sum(1 for block in prefix.blocks if bp.ref_count(pool, block) == 0)",
        "revived = 0",
        CORE,
    ),
    _m(
        "sched_admission_spends_no_encoder_budget",
        SS,
        "step.encoder, step.encoder_budget = encoder, encoder_budget",
        "step.encoder = encoder",
        CORE,
    ),
    # ---- core: encoder inputs and cache
    _m(
        "enc_input_starting_at_chunk_end_runs_early",
        ES,
        "if item.offset >= computed + num_new:",
        "if item.offset > computed + num_new:",
        CORE,
    ),
    _m(
        "enc_input_ending_at_computed_is_referenced_again",
        ES,
        "if item.end <= computed:",
        "if item.end < computed:",
        CORE,
    ),
    _m(
        "enc_blocked_input_inside_range_keeps_tokens",
        ES,
        "num_new = item.offset - computed if computed < item.offset else 0",
        "num_new = item.offset - computed if computed < item.offset else num_new",
        CORE,
    ),
    _m("enc_budget_not_spent", ES, "budget -= item.num_embeds", "budget -= 0", CORE),
    _m(
        "enc_work_goes_to_last_user",
        ES,
        "request_id, index = min(",
        "request_id, index = max(",
        CORE,
    ),
    _m(
        "enc_release_keeps_input_ending_at_computed",
        SST,
        "if upto is not None and item.end > upto:",
        "if upto is not None and item.end >= upto:",
        CORE,
    ),
    _m(
        "enc_cache_never_evicts_for_room",
        EC,
        "return num_embeds <= cache.num_free + cache.num_freeable",
        "return num_embeds <= cache.num_free",
        CORE,
    ),
    _m(
        "enc_cache_released_entry_evicted_first",
        EC,
        "freeable.append(content_hash)",
        "freeable.insert(0, content_hash)",
        CORE,
    ),
    _m(
        "enc_cache_frees_reallocated_entry",
        EC,
        "to_free = tuple(h for h in cache.evicted if h not in entries)",
        "to_free = cache.evicted",
        CORE,
    ),
    # ---- core: KV jobs
    _m(
        "jobs_unpin_head_first",
        KJ,
        "return jobs, kvc.unpin(kv, tuple(reversed(job.block_ids))), job",
        "return jobs, kvc.unpin(kv, job.block_ids), job",
        CORE,
    ),
    _m(
        "jobs_failed_load_planned_again",
        KJ,
        "stored = _forget(stored, job.block_hashes)",
        "stored = stored",
        CORE,
    ),
    _m(
        "jobs_evicted_keys_still_believed_stored",
        KJ,
        "stored = _forget(stored, result.evicted)",
        "stored = stored",
        CORE,
    ),
    _m(
        "jobs_load_reads_blocks_still_being_stored",
        KJ,
        "if block_hashes[position] not in jobs.stored or block_hashes[position] in jobs.storing:",
        "if block_hashes[position] not in jobs.stored:",
        CORE,
    ),
    _m(
        "jobs_store_repeats_a_hash_in_one_job",
        KJ,
        "if block_hash in jobs.stored or block_hash in jobs.storing or block_hash in seen:",
        "if block_hash in jobs.stored or block_hash in jobs.storing:",
        CORE,
    ),
    # ---- core: update and stop
    _m(
        "update_hashes_lag_one_token",
        UP,
        "if hashing and (total + 1) // block_size > len(hashes):",
        "if hashing and total // block_size > len(hashes):",
        CORE,
    ),
    _m(
        "stop_min_tokens_off_by_one",
        STOP,
        "if num_output >= params.min_tokens:",
        "if num_output > params.min_tokens:",
        CORE,
    ),
    _m(
        "stop_ignore_eos_ignored",
        STOP,
        "if eos and not params.ignore_eos and last in eos:",
        "if eos and last in eos:",
        CORE,
    ),
    _m(
        "stop_max_model_len_off_by_one",
        STOP,
        "if request.num_tokens >= max_model_len:",
        "if request.num_tokens > max_model_len:",
        CORE,
    ),
    _m(
        "stop_max_tokens_off_by_one",
        STOP,
        "if params.max_tokens is not None and num_output >= params.max_tokens:",
        "if params.max_tokens is not None and num_output > params.max_tokens:",
        CORE,
    ),
    # ---- sampler
    _m(
        "sampler_repetition_divides_negative_logits",
        SMP,
        "logits = jnp.where(logits > 0, logits / rep, logits * rep)",
        "logits = jnp.where(logits > 0, logits / rep, logits / rep)",
        SAMPLER,
    ),
    _m(
        "sampler_presence_counts_occurrences",
        SMP,
        "return logits - metadata.presence_penalty[:, None] * (out_counts > 0)",
        "return logits - metadata.presence_penalty[:, None] * out_counts",
        SAMPLER,
    ),
    _m(
        "sampler_repetition_ignores_prompt",
        SMP,
        "seen = (out_counts + prompt_counts) > 0",
        "seen = out_counts > 0",
        SAMPLER,
    ),
    _m(
        "sampler_rank_ignores_ties",
        SMP,
        "ranks = jnp.sum(logprobs >= chosen, axis=-1).astype(jnp.int32)",
        "ranks = jnp.sum(logprobs > chosen, axis=-1).astype(jnp.int32)",
        SAMPLER,
    ),
    _m(
        "sampler_min_p_absolute",
        SMP,
        "cutoff = metadata.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)",
        "cutoff = metadata.min_p[:, None]",
        SAMPLER,
    ),
    _m(
        "sampler_top_p_keeps_the_boundary_token",
        SMP,
        "keep = (key > above[:, None]) | (top_p[:, None] >= 1.0)",
        "keep = (key >= above[:, None]) | (top_p[:, None] >= 1.0)",
        SAMPLER,
    ),
    _m(
        "sampler_logit_bias_replaces",
        SMP,
        "logits = logits.at[rows, metadata.bias_ids].add(metadata.bias_values)",
        "logits = logits.at[rows, metadata.bias_ids].set(metadata.bias_values)",
        SAMPLER,
    ),
    _m(
        "sampler_logprobs_after_processing",
        SMP,
        "ids, values, ranks = gather_logprobs(raw_logprobs, token_ids, num_logprobs)",
        "ids, values, ranks = gather_logprobs(jax.nn.log_softmax(logits, -1), token_ids, num_logprobs)",
        SAMPLER,
    ),
    _m(
        "sampling_top_k_zero_is_not_off",
        SMD,
        "vocab_size if greedy or p.top_k in (0, -1) else min(p.top_k, vocab_size),",
        "vocab_size if greedy or p.top_k == -1 else min(p.top_k, vocab_size),",
        SAMPLER,
    ),
    _m(
        "sampling_seeded_stream_follows_the_step",
        SMD,
        "step_counter if p.seed is None else row.num_output_tokens",
        "step_counter if p.seed is None else step_counter",
        SAMPLER,
    ),
    _m(
        "sampling_min_tokens_off_by_one",
        SMD,
        "if p.min_tokens and row.num_output_tokens < p.min_tokens",
        "if p.min_tokens and row.num_output_tokens <= p.min_tokens",
        SAMPLER,
    ),
    _m(
        "sampling_ignore_eos_still_masks_eos",
        SMD,
        "(p.stop_token_ids + (() if p.ignore_eos else row.eos_token_ids))",
        "(p.stop_token_ids + row.eos_token_ids)",
        SAMPLER,
    ),
    _m(
        "sampling_repetition_alone_skips_penalties",
        SMD,
        "np.any(presence != 0) or np.any(frequency != 0) or np.any(repetition != 1)",
        "np.any(presence != 0) or np.any(frequency != 0)",
        SAMPLER,
    ),
    _m(
        "sampling_unseeded_rows_share_a_stream",
        SMD,
        "0 if p.seed is not None or v[0] else _request_salt(row.request_id)",
        "0 if p.seed is not None or v[0] else 1",
        SAMPLER,
    ),
    # ---- runner inputs
    _m(
        "inputs_slot_without_block_size",
        INP,
        "slots.append(table[c // bs] * bs + c % bs)",
        "slots.append(table[c // bs] + c % bs)",
        INPUTS,
    ),
    _m(
        "inputs_table_drops_partial_block",
        INP,
        "used = -(-end // bs)",
        "used = end // bs",
        INPUTS,
    ),
    _m(
        "inputs_chunk_slots_stop_short_of_a_block_end",
        INP,
        "slots.extend(range(base + max(c - b * bs, 0), base + min(end - b * bs, bs)))",
        "slots.extend(range(base + max(c - b * bs, 0), base + min(end - b * bs, bs - 1)))",
        INPUTS,
    ),
    _m(
        "inputs_prompt_logprob_rows_run_past_the_prompt",
        INP,
        "prompt_rows[rid] = (start, min(n, row.prompt_len - c))",
        "prompt_rows[rid] = (start, n)",
        INPUTS,
    ),
    _m(
        "inputs_resumed_request_samples_mid_recompute",
        INP,
        "if end >= len(row.token_ids):",
        "if end >= row.prompt_len:",
        INPUTS,
    ),
    # ---- model
    _m(
        "model_attention_reads_post_attention_norm",
        LLAMA,
        "h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)",
        "h, kv_cache = self.self_attn(self.post_attention_layernorm(x), cos, sin, kv_cache, batch)",
        MODEL,
    ),
    _m(
        "model_final_norm_skipped",
        LLAMA,
        "return tuple(new_caches), self.model.norm(x)",
        "return tuple(new_caches), x",
        MODEL,
    ),
    _m(
        "model_k_and_v_swapped_at_load",
        LLAMA,
        'qkv = (("q", nq), ("k", nkv), ("v", nkv))',
        'qkv = (("q", nq), ("v", nkv), ("k", nkv))',
        MODEL,
    ),
    _m(
        "model_rms_norm_without_eps",
        NORM,
        "return weight * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)",
        "return weight * (xf * jax.lax.rsqrt(var)).astype(x.dtype)",
        MODEL,
    ),
    _m(
        "model_rms_norm_scales_before_rounding",
        NORM,
        "return weight * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)",
        "return (weight.astype(jnp.float32) * xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)",
        MODEL,
    ),
    _m(
        "model_rotary_turns_backwards",
        ROPE,
        "return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)",
        "return jnp.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)",
        MODEL,
    ),
    _m(
        "model_llama3_rope_blend_swapped",
        ROPE,
        "smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled",
        "smoothed = (1 - smooth) * scaled + smooth * scaled / rope.factor",
        MODEL,
    ),
    _m(
        "model_linear_rope_multiplies",
        ROPE,
        "return (inv / np.float32(rope.factor)).astype(np.float32), 1.0",
        "return (inv * np.float32(rope.factor)).astype(np.float32), 1.0",
        MODEL,
    ),
    _m(
        "model_yarn_attention_factor_dropped",
        ROPE,
        "return inv.astype(np.float32), float(scale)",
        "return inv.astype(np.float32), 1.0",
        MODEL,
    ),
    _m(
        "model_softmax_scale_of_all_heads",
        ATTN,
        "sm_scale=d**-0.5,",
        "sm_scale=(hq * d) ** -0.5,",
        MODEL,
    ),
    _m(
        "model_k_normed_by_q_norm",
        ATTN,
        "q, k = self.q_norm(q), self.k_norm(k)",
        "q, k = self.q_norm(q), self.q_norm(k)",
        MODEL,
    ),
    _m(
        "model_gate_and_up_swapped",
        MLP,
        "return self.down_proj(jax.nn.silu(gate) * up)",
        "return self.down_proj(jax.nn.silu(up) * gate)",
        MODEL,
    ),
    _m(
        "model_linear_bias_dropped",
        LIN,
        "y = y + self.bias[...].astype(jnp.float32)",
        "y = y",
        MODEL,
    ),
    # ---- kernel references
    _m(
        "rpa_query_cannot_see_itself",
        RPA_REF,
        "mask = key_ok[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])",
        "mask = key_ok[:, None, :] & (k_pos[None, None, :] < q_pos[:, :, None])",
        RPA,
    ),
    _m(
        "rpa_sliding_window_off_by_one",
        RPA_REF,
        "mask &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window",
        "mask &= q_pos[:, :, None] - k_pos[None, None, :] <= sliding_window",
        RPA,
    ),
    _m(
        "rpa_non_finite_values_not_kept_out",
        RPA_REF,
        "vw = jnp.where(v_bad[..., None], 0.0, vw)",
        "vw = vw",
        RPA,
    ),
    _m(
        "rpa_soft_cap_unscaled",
        RPA_REF,
        "s = soft_cap * jnp.tanh(s / soft_cap)",
        "s = jnp.tanh(s / soft_cap)",
        RPA,
    ),
    _m(
        "flash_causal_mask_transposed",
        FLASH_REF,
        "mask = mask & jnp.tril(jnp.ones((s, s), bool))[None]",
        "mask = mask & jnp.triu(jnp.ones((s, s), bool))[None]",
        FLASH,
    ),
    _m(
        "flash_segments_see_earlier_segments",
        FLASH_REF,
        "mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])",
        "mask = mask & (segment_ids[:, :, None] >= segment_ids[:, None, :])",
        FLASH,
    ),
    _m(
        "kda_beta_dropped_from_update",
        KDA_REF,
        "s = s + beta[:, None, None] * u[:, :, None] * k[:, None, :]",
        "s = s + u[:, :, None] * k[:, None, :]",
        KDA,
    ),
    _m(
        "kda_value_heads_read_tiled_qk_heads",
        KDA_REF,
        "return jnp.repeat(q * scale, rep, axis=1), jnp.repeat(k, rep, axis=1)",
        "return jnp.tile(q * scale, (1, rep, 1)), jnp.tile(k, (1, rep, 1))",
        KDA,
    ),
    _m(
        "kda_decode_slot_zero_is_padding",
        KDA_REF,
        "live = state_indices >= 0",
        "live = state_indices > 0",
        KDA,
    ),
    _m(
        "mla_sink_not_shifted_by_max",
        MLA_REF,
        "denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :] - m_safe)",
        "denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :])",
        MLA,
    ),
    _m(
        "mla_topk_length_inclusive",
        MLA_REF,
        "ok &= pos < topk_lengths[:, None]",
        "ok &= pos <= topk_lengths[:, None]",
        MLA,
    ),
    _m(
        "mla_value_is_the_latent_tail",
        MLA_REF,
        'acc = jnp.einsum("thk,tkd->thd", p, rows[..., :d_v], precision=hi)',
        'acc = jnp.einsum("thk,tkd->thd", p, rows[..., -d_v:], precision=hi)',
        MLA,
    ),
)


# ---------------------------------------------------------------- running


def _matching_lines(text: str, original: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines(keepends=True)) if line.strip() == original]


def _mutate(text: str, line_index: int, mutated: str) -> str:
    lines = text.splitlines(keepends=True)
    line = lines[line_index]
    indent = line[: len(line) - len(line.lstrip())]
    ending = line[len(line.rstrip("\r\n")) :]
    lines[line_index] = indent + mutated + ending
    return "".join(lines)


def _drop_bytecode(path: Path) -> None:
    # A .pyc is trusted when the source's mtime (whole seconds) and size match; a same-size
    # mutant written within the second would otherwise run the unmutated bytecode.
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def _pytest(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    seconds = time.monotonic() - start
    # 0 passed; 1 a test failed; 2 collection failed (the mutant broke an import).
    outcome = {0: "passed", 1: "failed", 2: "failed"}.get(proc.returncode, "error")
    if outcome == "error":
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
    return outcome, seconds


def run_mutant(root: Path, mutant: Mutant, timeout: float) -> dict:
    path = root / mutant.file
    result = {"name": mutant.name, "file": mutant.file, "tests": list(mutant.tests)}
    original = path.read_bytes()
    text = original.decode()
    found = _matching_lines(text, mutant.original)
    if len(found) != 1:
        return {**result, "status": "stale", "detail": f"original line found {len(found)} times"}
    try:
        path.write_text(_mutate(text, found[0], mutant.mutated))
        _drop_bytecode(path)
        outcome, seconds = _pytest(root, mutant.tests, timeout)
    finally:
        path.write_bytes(original)
        _drop_bytecode(path)
    status = {"passed": "survived", "failed": "killed", "timeout": "killed", "error": "error"}
    return {**result, "status": status[outcome], "outcome": outcome, "seconds": round(seconds, 1)}


def _check_root(root: Path) -> None:
    git = ["git", "-C", str(root), "rev-parse", "--path-format=absolute"]
    dirs = subprocess.run(
        [*git, "--git-dir", "--git-common-dir"], capture_output=True, text=True, check=True
    ).stdout.split()
    if len(dirs) != 2 or dirs[0] == dirs[1]:
        raise SystemExit(
            f"{root} is the primary checkout; mutants would disturb everyone using it. Run from a "
            f"worktree: git -C {root} worktree add /tmp/mutants HEAD"
        )
    probe = "import model, runtime, pallas_kernels as p; print(runtime.__file__, p.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    if not all(Path(w).resolve().is_relative_to(root.resolve()) for w in where):
        raise SystemExit(f"tests started in {root} import the project from {where}, not {root}")


def _dirty(root: Path, files: set[str]) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--", *sorted(files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line[3:] for line in out.splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant")
    parser.add_argument("--check", action="store_true", help="only check the original lines")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="first run every test subset unmutated and stop if one fails (a red subset would "
        "count every mutant as killed)",
    )
    args = parser.parse_args(argv)
    names = {m.name for m in MUTANTS}
    if len(names) != len(MUTANTS):
        raise SystemExit("two mutants share a name")
    unknown = set(args.only or ()) - names
    if unknown:
        raise SystemExit(f"unknown mutants {sorted(unknown)}; known: {sorted(names)}")
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    root = args.root
    if args.check:
        stale = [
            m.name
            for m in chosen
            if len(_matching_lines((root / m.file).read_text(), m.original)) != 1
        ]
        print(json.dumps({"mutants": len(chosen), "stale": stale}, indent=2))
        return 1 if stale else 0
    _check_root(root)
    dirty = _dirty(root, {m.file for m in chosen})
    if dirty:
        raise SystemExit(f"uncommitted changes in {dirty}: the pass restores files it mutates")
    if args.baseline:
        for tests in dict.fromkeys(m.tests for m in chosen):
            outcome, seconds = _pytest(root, tests, args.timeout)
            sys.stderr.write(f"baseline  {outcome:6s} {seconds:7.1f}s  {' '.join(tests)}\n")
            if outcome != "passed":
                raise SystemExit(f"baseline {outcome}: {' '.join(tests)}")
    results = []
    for mutant in chosen:
        result = run_mutant(root, mutant, args.timeout)
        results.append(result)
        sys.stderr.write(
            f"{result['status']:9s} {result.get('seconds', 0):7.1f}s  {mutant.name}"
            f"  ({mutant.file})\n"
        )
        sys.stderr.flush()
    killed = [r for r in results if r["status"] == "killed"]
    survived = [r for r in results if r["status"] == "survived"]
    decided = len(killed) + len(survived)
    summary = {
        "mutants": len(results),
        "killed": len(killed),
        "survived": len(survived),
        "stale": [r["name"] for r in results if r["status"] == "stale"],
        "errors": [r["name"] for r in results if r["status"] == "error"],
        "kill_rate": round(len(killed) / decided, 3) if decided else None,
        "survivors": [r["name"] for r in survived],
        "results": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"killed {len(killed)} of {decided} ({summary['kill_rate']}); "
            f"survivors: {summary['survivors']}; stale: {summary['stale']}; "
            f"errors: {summary['errors']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
