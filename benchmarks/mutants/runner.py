"""Runner mutants: the sampler, its per-batch metadata, and the input builder."""

from benchmarks.mutants.mutant import Mutant

SAMPLER = ("tests/runtime/runner/test_sampler.py", "tests/runtime/runner/test_sampler_edges.py")
INPUTS = ("tests/runtime/runner", "tests/vlax/test_generate_hf_parity.py")

SMP = "runtime/runner/sampler.py"
SMD = "runtime/runner/sampling_metadata.py"
INP = "runtime/runner/inputs.py"

MUTANTS: tuple[Mutant, ...] = (
    # ---- sampler
    Mutant(
        "sampler_repetition_divides_negative_logits",
        SMP,
        "logits = jnp.where(logits > 0, logits / rep, logits * rep)",
        "logits = jnp.where(logits > 0, logits / rep, logits / rep)",
        SAMPLER,
    ),
    Mutant(
        "sampler_presence_counts_occurrences",
        SMP,
        "return logits - metadata.presence_penalty[:, None] * (out_counts > 0)",
        "return logits - metadata.presence_penalty[:, None] * out_counts",
        SAMPLER,
    ),
    Mutant(
        "sampler_repetition_ignores_prompt",
        SMP,
        "seen = (out_counts + prompt_counts) > 0",
        "seen = out_counts > 0",
        SAMPLER,
    ),
    Mutant(
        "sampler_rank_ignores_ties",
        SMP,
        "ranks = jnp.sum(logprobs >= chosen, axis=-1).astype(jnp.int32)",
        "ranks = jnp.sum(logprobs > chosen, axis=-1).astype(jnp.int32)",
        SAMPLER,
    ),
    Mutant(
        "sampler_min_p_absolute",
        SMP,
        "cutoff = metadata.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)",
        "cutoff = metadata.min_p[:, None]",
        SAMPLER,
    ),
    Mutant(
        "sampler_top_p_keeps_the_boundary_token",
        SMP,
        "keep = (key > above[:, None]) | (top_p[:, None] >= 1.0)",
        "keep = (key >= above[:, None]) | (top_p[:, None] >= 1.0)",
        SAMPLER,
    ),
    Mutant(
        "sampler_logit_bias_replaces",
        SMP,
        "logits = logits.at[rows, metadata.bias_ids].add(metadata.bias_values)",
        "logits = logits.at[rows, metadata.bias_ids].set(metadata.bias_values)",
        SAMPLER,
    ),
    Mutant(
        "sampler_logprobs_after_processing",
        SMP,
        "ids, values, ranks = gather_logprobs(raw_logprobs, token_ids, num_logprobs)",
        "ids, values, ranks = gather_logprobs(jax.nn.log_softmax(logits, -1), token_ids, num_logprobs)",
        SAMPLER,
    ),
    Mutant(
        "sampling_top_k_zero_is_not_off",
        SMD,
        "vocab_size if greedy or p.top_k in (0, -1) else min(p.top_k, vocab_size),",
        "vocab_size if greedy or p.top_k == -1 else min(p.top_k, vocab_size),",
        SAMPLER,
    ),
    Mutant(
        "sampling_seeded_stream_follows_the_step",
        SMD,
        "step_counter if p.seed is None else row.num_output_tokens",
        "step_counter if p.seed is None else step_counter",
        SAMPLER,
    ),
    Mutant(
        "sampling_min_tokens_off_by_one",
        SMD,
        "if p.min_tokens and row.num_output_tokens < p.min_tokens",
        "if p.min_tokens and row.num_output_tokens <= p.min_tokens",
        SAMPLER,
    ),
    Mutant(
        "sampling_ignore_eos_still_masks_eos",
        SMD,
        "(p.stop_token_ids + (() if p.ignore_eos else row.eos_token_ids))",
        "(p.stop_token_ids + row.eos_token_ids)",
        SAMPLER,
    ),
    Mutant(
        "sampling_repetition_alone_skips_penalties",
        SMD,
        "np.any(presence != 0) or np.any(frequency != 0) or np.any(repetition != 1)",
        "np.any(presence != 0) or np.any(frequency != 0)",
        SAMPLER,
    ),
    Mutant(
        "sampling_unseeded_rows_share_a_stream",
        SMD,
        "0 if p.seed is not None or v[0] else _request_salt(row.request_id)",
        "0 if p.seed is not None or v[0] else 1",
        SAMPLER,
    ),
    # ---- runner inputs
    Mutant(
        "inputs_slot_without_block_size",
        INP,
        "slots.append(table[c // bs] * bs + c % bs)",
        "slots.append(table[c // bs] + c % bs)",
        INPUTS,
    ),
    Mutant(
        "inputs_table_drops_partial_block",
        INP,
        "used = -(-end // bs)",
        "used = end // bs",
        INPUTS,
    ),
    Mutant(
        "inputs_chunk_slots_stop_short_of_a_block_end",
        INP,
        "slots.extend(range(base + max(c - b * bs, 0), base + min(end - b * bs, bs)))",
        "slots.extend(range(base + max(c - b * bs, 0), base + min(end - b * bs, bs - 1)))",
        INPUTS,
    ),
    Mutant(
        "inputs_prompt_logprob_rows_run_past_the_prompt",
        INP,
        "prompt_rows[rid] = (start, min(n, row.prompt_len - c))",
        "prompt_rows[rid] = (start, n)",
        INPUTS,
    ),
    Mutant(
        "inputs_resumed_request_samples_mid_recompute",
        INP,
        "if end >= len(row.token_ids):",
        "if end >= row.prompt_len:",
        INPUTS,
    ),
)
