"""Core mutants: block hashes, block pool, KV cache, scheduler, encoder inputs and cache, KV
jobs, update and stop. All run against tests/runtime/core."""

from benchmarks.mutants.mutant import Mutant

CORE = ("tests/runtime/core",)

BH = "runtime/core/kv/block_hash.py"
BP = "runtime/core/kv/block_pool.py"
KVC = "runtime/core/kv/kv_cache.py"
SS = "runtime/core/scheduling/plan_step.py"
AO = "runtime/core/scheduling/assemble_output.py"
ES = "runtime/core/scheduling/encoder_scheduling.py"
SST = "runtime/core/scheduling/scheduler_state.py"
EC = "runtime/core/encoder/encoder_cache.py"
KJ = "runtime/core/kv_jobs/jobs.py"
UP = "runtime/core/scheduling/apply_output.py"
STOP = "runtime/core/scheduling/stop.py"

MUTANTS: tuple[Mutant, ...] = (
    # ---- core: block hashes
    Mutant(
        "hash_span_ending_at_block_start_keys_it",
        BH,
        "first_span = bisect_right(span_ends, start)",
        "first_span = bisect_right(span_ends, start - 1)",
        CORE,
    ),
    Mutant(
        "hash_span_starting_at_next_block_keys_this_one",
        BH,
        "if offset >= start + block_size:",
        "if offset > start + block_size:",
        CORE,
    ),
    Mutant("hash_salt_on_every_block", BH, "if index == 0:", "if index >= 0:", CORE),
    Mutant(
        "hash_ignores_span_offset",
        BH,
        "digest.update(_I64.pack(offset))",
        "pass",
        CORE,
    ),
    # ---- core: block pool
    Mutant(
        "pool_cached_run_ignores_limit",
        BP,
        "for position in range(min(limit, len(block_hashes))):",
        "for position in range(len(block_hashes)):",
        CORE,
    ),
    Mutant("pool_double_free_refrees", BP, "if count == 1:", "if count <= 1:", CORE),
    Mutant("pool_touch_keeps_num_free", BP, "num_free -= 1", "num_free -= 0", CORE),
    Mutant(
        "pool_fresh_range_off_by_one",
        BP,
        "num_fresh = min(n - len(taken), pool.num_blocks - pool.next_fresh)",
        "num_fresh = min(n - len(taken), pool.num_blocks - pool.next_fresh - 1)",
        CORE,
    ),
    Mutant(
        "pool_evicting_last_duplicate_drops_first_holder",
        BP,
        "if block in dup or index[block_hash] != block:",
        "if block in dup:",
        CORE,
    ),
    # ---- core: kv cache
    Mutant(
        "kv_full_prompt_hit_leaves_nothing_to_compute",
        KVC,
        "state.pool, request.block_hashes, (num_tokens - 1) // state.pool.block_size",
        "state.pool, request.block_hashes, num_tokens // state.pool.block_size",
        CORE,
    ),
    Mutant(
        "kv_free_head_first",
        KVC,
        "bp.release(state.pool, reversed(table)),",
        "bp.release(state.pool, table),",
        CORE,
    ),
    Mutant(
        "kv_revived_blocks_not_counted",
        KVC,
        "num_revived = sum(1 for block in cached_blocks if bp.is_free(pool, block))",
        "num_revived = 0",
        CORE,
    ),
    Mutant(
        "kv_lookahead_not_capped",
        KVC,
        "slots = min(filled + lookahead, state.max_model_len)",
        "slots = filled + lookahead",
        CORE,
    ),
    Mutant(
        "kv_caches_partial_block",
        KVC,
        "num_full = max(num_cached, min(filled // block_size, len(block_hashes)))",
        "num_full = max(num_cached, min(-(-filled // block_size), len(block_hashes)))",
        CORE,
    ),
    Mutant(
        "kv_max_model_len_off_by_one",
        KVC,
        "if filled > state.max_model_len:",
        "if filled >= state.max_model_len:",
        CORE,
    ),
    # ---- core: scheduler
    Mutant("sched_fcfs_preempts_first", SS, "return len(step.running) - 1", "return 0", CORE),
    Mutant(
        "sched_priority_preempts_most_urgent",
        SS,
        "return keys.index(max(keys))",
        "return keys.index(min(keys))",
        CORE,
    ),
    Mutant(
        "sched_long_prefill_cap_never_lifted",
        SS,
        "many = len(state.running) + len(state.waiting) + len(holding) > 1",
        "many = len(state.running) + len(state.waiting) + len(holding) >= 1",
        CORE,
    ),
    Mutant(
        "sched_no_chunking_budget_boundary",
        SS,
        "if not config.enable_chunked_prefill and num_new > step.token_budget:",
        "if not config.enable_chunked_prefill and num_new >= step.token_budget:",
        CORE,
    ),
    Mutant("sched_admits_after_preempting", SS, "if not step.preempted:", "if True:", CORE),
    Mutant(
        "sched_reservation_ignores_revived_blocks",
        SS,
        "revived = sum(1 for block in prefix.blocks if bp.ref_count(pool, block) == 0)",
        "revived = 0",
        CORE,
    ),
    Mutant(
        "sched_admission_spends_no_encoder_budget",
        SS,
        "step.encoder, step.encoder_budget = encoder, encoder_budget",
        "step.encoder = encoder",
        CORE,
    ),
    # ---- core: recurrent-state slots (hybrid models)
    Mutant(
        "slots_preempted_request_keeps_its_slot",
        SS,
        "step.slots = ss.release(step.slots, request_id)",
        "step.slots = step.slots",
        CORE,
    ),
    Mutant(
        "slots_admission_ignores_the_free_count",
        SS,
        "if step.slots is not None and not step.slots.free:",
        "if False:",
        CORE,
    ),
    Mutant(
        "slots_resumed_request_not_reset",
        AO,
        "reset_state_slots = tuple(sorted(owners[request_id] for request_id, _, _ in step.admitted))",
        "reset_state_slots = tuple(sorted(owners[r] for r, resumed, _ in step.admitted if not resumed))",
        CORE,
    ),
    Mutant(
        "slots_finished_request_keeps_its_slot",
        UP,
        "slots = ss.release(slots, request_id)",
        "slots = slots",
        CORE,
    ),
    # ---- core: encoder inputs and cache
    Mutant(
        "enc_input_starting_at_chunk_end_runs_early",
        ES,
        "if item.offset >= computed + num_new:",
        "if item.offset > computed + num_new:",
        CORE,
    ),
    Mutant(
        "enc_input_ending_at_computed_is_referenced_again",
        ES,
        "if item.end <= computed:",
        "if item.end < computed:",
        CORE,
    ),
    Mutant(
        "enc_blocked_input_inside_range_keeps_tokens",
        ES,
        "num_new = item.offset - computed if computed < item.offset else 0",
        "num_new = item.offset - computed if computed < item.offset else num_new",
        CORE,
    ),
    Mutant("enc_budget_not_spent", ES, "budget -= item.num_embeds", "budget -= 0", CORE),
    Mutant(
        "enc_work_goes_to_last_user",
        ES,
        "request_id, index = min(",
        "request_id, index = max(",
        CORE,
    ),
    Mutant(
        "enc_release_keeps_input_ending_at_computed",
        SST,
        "if upto is not None and item.end > upto:",
        "if upto is not None and item.end >= upto:",
        CORE,
    ),
    Mutant(
        "enc_cache_never_evicts_for_room",
        EC,
        "return num_embeds <= cache.num_free + cache.num_freeable",
        "return num_embeds <= cache.num_free",
        CORE,
    ),
    Mutant(
        "enc_cache_released_entry_evicted_first",
        EC,
        "freeable.append(content_hash)",
        "freeable.insert(0, content_hash)",
        CORE,
    ),
    Mutant(
        "enc_cache_frees_reallocated_entry",
        EC,
        "to_free = tuple(h for h in cache.evicted if h not in entries)",
        "to_free = cache.evicted",
        CORE,
    ),
    # ---- core: KV jobs
    Mutant(
        "jobs_unpin_head_first",
        KJ,
        "return jobs, kvc.unpin(kv, tuple(reversed(job.block_ids))), job",
        "return jobs, kvc.unpin(kv, job.block_ids), job",
        CORE,
    ),
    Mutant(
        "jobs_failed_load_planned_again",
        KJ,
        "stored = _forget(stored, job.block_hashes)",
        "stored = stored",
        CORE,
    ),
    Mutant(
        "jobs_evicted_keys_still_believed_stored",
        KJ,
        "stored = _forget(stored, result.evicted)",
        "stored = stored",
        CORE,
    ),
    Mutant(
        "jobs_load_reads_blocks_still_being_stored",
        KJ,
        "if block_hashes[position] not in jobs.stored or block_hashes[position] in jobs.storing:",
        "if block_hashes[position] not in jobs.stored:",
        CORE,
    ),
    Mutant(
        "jobs_store_repeats_a_hash_in_one_job",
        KJ,
        "if block_hash in jobs.stored or block_hash in jobs.storing or block_hash in seen:",
        "if block_hash in jobs.stored or block_hash in jobs.storing:",
        CORE,
    ),
    # ---- core: update and stop
    Mutant(
        "update_hashes_lag_one_token",
        UP,
        "if hashing and (total + 1) // block_size > len(hashes):",
        "if hashing and total // block_size > len(hashes):",
        CORE,
    ),
    Mutant(
        "stop_min_tokens_off_by_one",
        STOP,
        "if num_output >= params.min_tokens:",
        "if num_output > params.min_tokens:",
        CORE,
    ),
    Mutant(
        "stop_ignore_eos_ignored",
        STOP,
        "if eos and not params.ignore_eos and last in eos:",
        "if eos and last in eos:",
        CORE,
    ),
    Mutant(
        "stop_max_model_len_off_by_one",
        STOP,
        "if request.num_tokens >= max_model_len:",
        "if request.num_tokens > max_model_len:",
        CORE,
    ),
    Mutant(
        "stop_max_tokens_off_by_one",
        STOP,
        "if params.max_tokens is not None and num_output >= params.max_tokens:",
        "if params.max_tokens is not None and num_output > params.max_tokens:",
        CORE,
    ),
)
