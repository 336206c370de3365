"""Differential check: vlax's scheduler against vLLM 0.33's V1 scheduler, step by step.

Both schedulers get the same requests, arrivals, aborts and synthetic sampled tokens (text only);
every step must give the same:
- tokens scheduled per request, and preempted ids in order;
- computed tokens of each scheduled request before the step (so prefix-hit lengths at
  admission, and the recompute of resumed requests);
- running queue, in order;
- free blocks after schedule() and after update(), and, for pools of at most
  `FREE_ORDER_MAX_BLOCKS` blocks, the whole free queue in eviction order;
- requests that finished in update(), with their reason (max_tokens, max_model_len).
With `--async`, vLLM's AsyncScheduler against vlax's async mode (SchedulerConfig.async_scheduling):
step N+1 is scheduled before step N's output is applied (vLLM's engine core order with one step
in flight: schedule N+1, update N), so step N+1 is planned with step N's tokens as placeholders;
the synthetic token of a step is a function of its position, known when the step is planned.
A separate `block_pool` row drives vLLM's BlockPool and vlax's block pool with the same random
take / cache / hit / release operations and compares the free queue and hash lookups after each.

Workloads (`--cases`; each runs once per seed of `--seeds`): benchmarks/scheduler_diff_workloads.py.

vLLM is not a project dependency: run this from a separate environment, e.g.

    python3 -m venv --system-site-packages /tmp/vllmenv
    /tmp/vllmenv/bin/pip install vllm==0.33.0 --no-deps   # or the wheel file
    /tmp/vllmenv/bin/pip install cbor2 openai openai-harmony pybase64 cachetools msgspec \
        xgrammar fastapi partial-json-parser llguidance einops   # what it imports here
    /tmp/vllmenv/bin/python benchmarks/vllm_scheduler_diff.py            # every case, 6 seeds
    /tmp/vllmenv/bin/python benchmarks/vllm_scheduler_diff.py --cases priority --seeds 3 --json

    /tmp/vllmenv/bin/python benchmarks/vllm_scheduler_diff.py --async      # the async modes

vLLM's Scheduler is built from a folder holding only a tiny config.json, with
skip_tokenizer_init=True and DeviceConfig(device="cuda"), which touches no GPU. Exit status 0
only if every run matched.
"""

import argparse
import json
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.scheduler_diff_workloads import WORKLOADS, make_workload  # noqa: E402
from benchmarks.scheduler_overhead import BLOCK_SIZE, MAX_MODEL_LEN  # noqa: E402
from runtime.core import scheduler as sch  # noqa: E402
from runtime.core.kv import block_pool as bp  # noqa: E402
from runtime.core.kv import kv_cache as kvc  # noqa: E402
from runtime.core.outputs import ModelRunnerOutput  # noqa: E402
from runtime.core.request import Request, RequestStatus  # noqa: E402

FREE_ORDER_MAX_BLOCKS = 2048
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}
ABORT_KINDS = ("running", "waiting", "preempted")


def token(num_tokens: int, num_prompt_tokens: int) -> int:
    """The synthetic model's next token, the same for both schedulers."""
    return (num_tokens * 7919 + num_prompt_tokens) % 30000 + 3


# ---------------------------------------------------------------- vLLM side


def make_vllm_scheduler(case: dict, model_dir: str, async_mode: bool = False):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_model_len = case.get("max_model_len", MAX_MODEL_LEN)
    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float16"
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_tokens"],
        max_model_len=max_model_len,
        enable_chunked_prefill=case.get("chunked_prefill", True),
        long_prefill_token_threshold=case.get("long_prefill", 0),
        policy=case.get("policy", "fcfs"),
        is_encoder_decoder=False,
        async_scheduling=async_mode,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE, enable_prefix_caching=case.get("prefix_caching", True)
    )
    cache_config.num_gpu_blocks = case["num_blocks"]
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cuda"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=case["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float16
                ),
            )
        ],
    )
    scheduler = (AsyncScheduler if async_mode else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )
    # SchedulerOutput.preempted_req_ids is a set; record the order of preemptions as they happen
    # (an observer only: the method itself runs unchanged).
    scheduler.preemption_order = []
    preempt = scheduler._preempt_request

    def recording_preempt(request, *args, **kwargs):
        scheduler.preemption_order.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = recording_preempt
    return scheduler


def vllm_request(request: Request):
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request as VllmRequest

    init_none_hash(sha256)
    params = request.sampling_params
    return VllmRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=VllmSamplingParams(
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            prompt_logprobs=params.prompt_logprobs,
        ),
        pooling_params=None,
        arrival_time=request.arrival_time,
        priority=request.priority,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def vllm_schedule(scheduler, check_order: bool) -> tuple[dict, object, object]:
    """schedule(): the row's schedule fields, the output, and the runner's output for it."""
    from vllm.v1.outputs import ModelRunnerOutput as VllmRunnerOutput

    pool = scheduler.kv_cache_manager.block_pool
    scheduler.preemption_order.clear()
    out = scheduler.schedule()
    assert set(scheduler.preemption_order) == set(out.preempted_req_ids or ())
    req_ids = list(out.num_scheduled_tokens)
    sampled, computed = [], {}
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        # vLLM advances num_computed_tokens inside schedule(); the sampled token's position is
        # the advanced count (async: placeholders included), and it samples unless mid-prefill.
        position = request.num_computed_tokens
        computed[request_id] = position - out.num_scheduled_tokens[request_id]
        done = not request.is_prefill_chunk
        sampled.append([token(position, request.num_prompt_tokens)] if done else [])
    row = {
        "scheduled": dict(out.num_scheduled_tokens),
        "preempted": list(scheduler.preemption_order),
        "computed_before": computed,
        "running": [r.request_id for r in scheduler.running],
        "free_after_schedule": pool.get_num_free_blocks(),
    }
    if check_order:
        row["free_order"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    runner_output = VllmRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    return row, out, runner_output


def vllm_update(scheduler, out, runner_output) -> dict:
    pool = scheduler.kv_cache_manager.block_pool
    engine_outputs = scheduler.update_from_output(out, runner_output)
    row = {}
    row["finished"] = {
        o.request_id: o.finish_reason.name.lower()
        for outputs in engine_outputs.values()
        for o in outputs.outputs
        if o.finish_reason is not None
    }
    row["free_after_update"] = pool.get_num_free_blocks()
    return row


def vllm_abort(scheduler, request_id: str) -> str:
    """Abort one request; returns its vLLM status name before the abort."""
    from vllm.v1.request import RequestStatus as VllmStatus

    status = scheduler.requests[request_id].status.name
    scheduler.finish_requests(request_id, VllmStatus.FINISHED_ABORTED)
    return status


# ---------------------------------------------------------------- vlax side


def make_vlax_scheduler(case: dict, async_mode: bool = False) -> sch.SchedulerState:
    return sch.make_scheduler(
        sch.SchedulerConfig(
            max_num_seqs=case["max_num_seqs"],
            max_num_batched_tokens=case["max_tokens"],
            max_model_len=case.get("max_model_len", MAX_MODEL_LEN),
            block_size=BLOCK_SIZE,
            num_blocks=case["num_blocks"],
            enable_prefix_caching=case.get("prefix_caching", True),
            enable_chunked_prefill=case.get("chunked_prefill", True),
            long_prefill_token_threshold=case.get("long_prefill", 0),
            policy=case.get("policy", "fcfs"),
            async_scheduling=async_mode,
        )
    )


def vlax_schedule(state: sch.SchedulerState, check_order: bool) -> tuple:
    """schedule(): the new state, the row's schedule fields, the output and the runner's."""
    state, out = sch.schedule(state)
    rows, computed = [], {}
    # Positions from the output (async: they count the steps in flight).
    position_of = {
        data.req_id: data.num_computed_tokens
        for data in (*out.scheduled_new_reqs, *out.scheduled_cached_reqs)
    }
    for request_id, n in out.num_scheduled_tokens.items():
        request = state.requests[request_id]
        computed[request_id] = position_of[request_id]
        if state.config.async_scheduling:
            done = state.in_flight[request_id][-1][2]
        else:
            done = request.num_computed_tokens + n >= request.num_tokens
        position = position_of[request_id] + n
        rows.append((token(position, request.num_prompt_tokens),) if done else ())
    row = {
        "scheduled": dict(out.num_scheduled_tokens),
        "preempted": list(out.preempted_req_ids),
        "computed_before": computed,
        "running": list(state.running),
        "free_after_schedule": kvc.num_free_blocks(state.kv),
    }
    if check_order:
        row["free_order"] = list(bp.free_order(state.kv.pool))
    runner_output = ModelRunnerOutput(tuple(out.num_scheduled_tokens), tuple(rows))
    return state, row, out, runner_output


def vlax_update(state: sch.SchedulerState, out, runner_output) -> tuple:
    """update(): the new state, the row's update fields, and how many requests finished at
    max_model_len."""
    before = state
    state, outputs = sch.update(state, out, runner_output)
    row = {}
    row["finished"] = {o.req_id: o.finish_reason.value for o in outputs if o.finished}
    row["free_after_update"] = kvc.num_free_blocks(state.kv)
    capped = sum(
        1
        for request_id in row["finished"]
        if before.requests[request_id].num_tokens + 1 >= state.config.max_model_len
    )
    return state, row, capped


def abort_candidates(state: sch.SchedulerState, kind: str) -> list[str]:
    if kind == "running":
        return sorted(state.running)
    status = RequestStatus.WAITING if kind == "waiting" else RequestStatus.PREEMPTED
    return sorted(rid for rid in state.waiting if state.requests[rid].status is status)


# ---------------------------------------------------------------- comparison


def compare(name: str, seed: int, model_dir: str, async_mode: bool = False) -> dict:
    case = WORKLOADS[name]
    workload, abort_steps = make_workload(case, seed)
    rng = random.Random(seed + 1_000_003)
    vllm_scheduler = make_vllm_scheduler(case, model_dir, async_mode)
    state = make_vlax_scheduler(case, async_mode)
    # Async: the step scheduled last and not yet applied, (vlax out, runner out, vLLM out,
    # vLLM runner out); its update follows the next schedule (one step in flight).
    pending = None
    check_order = case["num_blocks"] <= FREE_ORDER_MAX_BLOCKS
    abort_steps = set(abort_steps)
    stats = {"preemptions": 0, "prefix_hit_tokens": 0, "finished": 0, "capped": 0}
    stats.update({f"aborted_{kind}": 0 for kind in ABORT_KINDS})
    next_arrival = due_aborts = steps = 0
    mismatch = None
    while next_arrival < len(workload) or sch.has_unfinished_requests(state) or pending:
        while next_arrival < len(workload) and workload[next_arrival][0] <= steps:
            request = workload[next_arrival][1]
            state = sch.add_request(state, request)
            vllm_scheduler.add_request(vllm_request(request))
            next_arrival += 1
        due_aborts += steps in abort_steps
        while due_aborts and mismatch is None:
            kind = rng.choice(ABORT_KINDS)
            candidates = abort_candidates(state, kind)
            if not candidates:
                break  # due again next step
            victim = rng.choice(candidates)
            state = sch.abort_requests(state, [victim])
            status = vllm_abort(vllm_scheduler, victim)
            if status != kind.upper():
                mismatch = {"step": steps, "aborted": victim, "vlax": kind, "vllm": status}
            stats[f"aborted_{kind}"] += 1
            due_aborts -= 1
        if mismatch is not None:
            break
        running_before = set(state.running)
        scheduled = None
        if next_arrival < len(workload) or sch.has_unfinished_requests(state):
            state, ours, out, runner_out = vlax_schedule(state, check_order)
            theirs, vllm_out, vllm_runner_out = vllm_schedule(vllm_scheduler, check_order)
            scheduled = (out, runner_out, vllm_out, vllm_runner_out)
        else:
            ours, theirs = {}, {}  # async: only the last step's update is left
        if not async_mode:
            pending, scheduled = scheduled, None
        capped = 0
        if pending is not None:
            state, ours_update, capped = vlax_update(state, *pending[:2])
            ours.update(ours_update)
            theirs.update(vllm_update(vllm_scheduler, *pending[2:]))
        pending = scheduled
        if ours != theirs:
            fields = [key for key in ours if ours[key] != theirs.get(key)]
            mismatch = {
                "step": steps,
                "fields": fields,
                "vlax": {key: ours[key] for key in fields},
                "vllm": {key: theirs.get(key) for key in fields},
            }
            break
        stats["preemptions"] += len(ours.get("preempted", ()))
        stats["prefix_hit_tokens"] += sum(
            computed
            for request_id, computed in ours.get("computed_before", {}).items()
            if request_id not in running_before
        )
        stats["finished"] += len(ours.get("finished", ()))
        stats["capped"] += capped
        steps += 1
        if steps > 100_000:
            raise RuntimeError(f"{name}: no end after {steps} steps")
    return {
        "case": name,
        "seed": seed,
        "steps": steps,
        "match": mismatch is None,
        **stats,
        "first_mismatch": mismatch,
    }


# ---------------------------------------------------------------- block pool


def compare_block_pool(seed: int, num_blocks: int = 12, num_ops: int = 400) -> dict:
    """Random take / cache / hit / release on vLLM's BlockPool and vlax's block pool."""
    import hashlib

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    rng = random.Random(seed)
    caching = seed % 3 != 2  # vLLM without caching puts every freed block at the front
    theirs = BlockPool(num_blocks, caching, BLOCK_SIZE)
    ours = bp.make_block_pool(num_blocks, BLOCK_SIZE)
    # Few distinct hashes, so several blocks hold equal content.
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(6)]
    held: list[int] = []  # one entry per reference
    counts = dict.fromkeys(BLOCK_POOL_OPS, 0)
    mismatch = None
    for position in range(num_ops):
        op = rng.choice(("take", "take", "cache", "hit", "release", "release"))
        if op == "take":
            n = rng.randint(0, min(3, ours.num_free))
            ours, taken = bp.take_free_blocks(ours, n)
            their_taken = tuple(b.block_id for b in theirs.get_new_blocks(n))
            held += taken
            if their_taken != taken:
                mismatch = {"op": position, "taken": {"vlax": taken, "vllm": their_taken}}
        elif op == "cache" and caching:
            unhashed = sorted({b for b in held if bp.block_hash_of(ours, b) is None})
            if not unhashed:
                continue
            block, block_hash = rng.choice(unhashed), rng.choice(hashes)
            ours = bp.cache_blocks(ours, (block,), (block_hash,))
            key = make_block_hash_with_group_id(block_hash, 0)
            theirs._insert_block_hash(key, theirs.blocks[block], num_tokens=None)
        elif op == "hit" and caching:
            block = bp.lookup_cached(ours, rng.choice(hashes))
            if block is None:
                continue
            ours = bp.touch(ours, (block,))
            theirs.touch([theirs.blocks[block]])
            held.append(block)
        elif op == "release" and held:
            rng.shuffle(held)
            count = rng.randint(1, len(held))
            batch, held = held[:count], held[count:]
            ours = bp.release(ours, batch)
            theirs.free_blocks([theirs.blocks[b] for b in batch])
        else:
            continue
        counts[op] += 1
        order = tuple(b.block_id for b in theirs.free_block_queue.get_all_free_blocks())
        lookups = [bp.lookup_cached(ours, h) for h in hashes]
        their_lookups = [
            (lambda found: found[0].block_id if found else None)(theirs.get_cached_block(h, [0]))
            for h in hashes
        ]
        if mismatch is None and order != bp.free_order(ours):
            mismatch = {"op": position, "free_order": {"vlax": bp.free_order(ours), "vllm": order}}
        if mismatch is None and lookups != their_lookups:
            mismatch = {"op": position, "lookups": {"vlax": lookups, "vllm": their_lookups}}
        if mismatch is not None:
            break
    return {
        "case": "block_pool",
        "seed": seed,
        "match": mismatch is None,
        **counts,
        "first_mismatch": mismatch,
    }


# ---------------------------------------------------------------- main


SUMMED = (
    "steps",
    "preemptions",
    "prefix_hit_tokens",
    "finished",
    "capped",
    "aborted_running",
    "aborted_waiting",
    "aborted_preempted",
)


BLOCK_POOL_OPS = ("take", "cache", "hit", "release")


def summarize(rows: list[dict]) -> dict:
    summary = {"seeds": len(rows), "matched": sum(row["match"] for row in rows)}
    for key in (*SUMMED, *BLOCK_POOL_OPS):
        if key in rows[0]:
            summary[key] = sum(row[key] for row in rows)
    summary["mismatches"] = [
        {"seed": row["seed"], **row["first_mismatch"]} for row in rows if not row["match"]
    ]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--seeds", type=int, default=6, help="run seeds 0..N-1 of every case (default 6)"
    )
    parser.add_argument("--first-seed", type=int, default=0)
    names = [*WORKLOADS, "block_pool"]
    parser.add_argument("--cases", nargs="+", choices=names, default=names)
    parser.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="vLLM's AsyncScheduler against vlax's async mode (one step in flight)",
    )
    args = parser.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        pathlib.Path(model_dir, "config.json").write_text(json.dumps(TINY_CONFIG))
        for name in args.cases:
            start = time.perf_counter()
            if name == "block_pool":
                rows = [compare_block_pool(seed) for seed in seeds]
            else:
                rows = [compare(name, seed, model_dir, args.async_mode) for seed in seeds]
            results[name] = {**summarize(rows), "wall_s": round(time.perf_counter() - start, 1)}
            if not args.json:
                print(_line(name, results[name]), flush=True)
    if args.json:
        print(json.dumps(results))
    return 0 if all(row["matched"] == row["seeds"] for row in results.values()) else 1


def _line(name: str, row: dict) -> str:
    figures = ", ".join(f"{key} {row[key]}" for key in (*SUMMED, *BLOCK_POOL_OPS) if key in row)
    verdict = "all identical" if not row["mismatches"] else f"DIFFER {row['mismatches'][0]}"
    return f"{name}: {row['matched']}/{row['seeds']} seeds match; {figures}; {verdict}"


if __name__ == "__main__":
    raise SystemExit(main())
