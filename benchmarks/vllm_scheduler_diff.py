"""Differential check: vlax's scheduler against vLLM V1's synchronous scheduler, step by step.

FCFS, text-only requests, prefix caching and chunked prefill on. Both schedulers get the same
requests (the scheduler_overhead workloads, plus a tighter pool that preempts more) and the same
synthetic sampled tokens; every step must schedule the same tokens per request and preempt the
same requests. vLLM is not a project dependency: run this from a separate environment, e.g.

    python3 -m venv --system-site-packages /tmp/vllmenv
    /tmp/vllmenv/bin/pip install vllm==0.33.0 --no-deps   # + the pure-Python deps it imports
    /tmp/vllmenv/bin/python benchmarks/vllm_scheduler_diff.py --json

vLLM's Scheduler is built from a folder holding only a tiny config.json, with
skip_tokenizer_init=True and DeviceConfig(device="cuda"), which touches no GPU.

Each case runs twice: against vLLM as shipped, and with vLLM's free queue aligned to vlax's
block pool (`--align-free-order`). vLLM 0.33 puts freed blocks that hold no hash at the FRONT of
its free queue (reused first) and hashed ones at the tail; vlax's block pool appends every freed
block to the tail in the order given. Under eviction pressure that changes which cached blocks
survive, hence later prefix hits; the aligned run checks that nothing else differs.
"""

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.scheduler_overhead import BLOCK_SIZE, CASES, MAX_MODEL_LEN, make_requests  # noqa: E402
from runtime.core import scheduler as sch  # noqa: E402
from runtime.core.outputs import ModelRunnerOutput  # noqa: E402

WORKLOADS = {
    **{name: dict(case) for name, case in CASES.items()},
    "tight": {"requests": 100, "num_blocks": 256, "max_num_seqs": 64, "max_tokens": 512},
}
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": MAX_MODEL_LEN,
    "torch_dtype": "float16",
}


def token(num_tokens: int, num_prompt_tokens: int) -> int:
    """The synthetic model's next token, the same for both schedulers."""
    return (num_tokens * 7919 + num_prompt_tokens) % 30000 + 3


def make_vllm_scheduler(case: dict, model_dir: str):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float16"
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=case["max_num_seqs"],
        max_num_batched_tokens=case["max_tokens"],
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
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
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


def vllm_request(request):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = request.sampling_params
    return Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos),
        pooling_params=None,
        arrival_time=request.arrival_time,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def vllm_step(scheduler):
    from vllm.v1.outputs import ModelRunnerOutput as VllmRunnerOutput

    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        # vLLM advances num_computed_tokens inside schedule().
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([token(request.num_tokens, request.num_prompt_tokens)] if done else [])
    runner_output = VllmRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    scheduler.update_from_output(out, runner_output)
    return dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids or ())


def vlax_step(state):
    state, out = sch.schedule(state)
    rows = []
    for request_id, n in out.num_scheduled_tokens.items():
        request = state.requests[request_id]
        done = request.num_computed_tokens + n >= request.num_tokens
        rows.append((token(request.num_tokens, request.num_prompt_tokens),) if done else ())
    runner_output = ModelRunnerOutput(tuple(out.num_scheduled_tokens), tuple(rows))
    state, _ = sch.update(state, out, runner_output)
    return state, dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids)


def compare(name: str, seed: int, model_dir: str) -> dict:
    case = WORKLOADS[name]
    requests = make_requests(case["requests"], seed)
    vllm_scheduler = make_vllm_scheduler(case, model_dir)
    state = sch.make_scheduler(
        sch.SchedulerConfig(
            max_num_seqs=case["max_num_seqs"],
            max_num_batched_tokens=case["max_tokens"],
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            num_blocks=case["num_blocks"],
        )
    )
    for request in requests:
        vllm_scheduler.add_request(vllm_request(request))
        state = sch.add_request(state, request)
    steps = preemptions = 0
    first_mismatch = None
    while sch.has_unfinished_requests(state) or vllm_scheduler.has_unfinished_requests():
        ours = vlax_step(state)
        state, ours = ours[0], ours[1:]
        theirs = vllm_step(vllm_scheduler)
        if ours != theirs and first_mismatch is None:
            first_mismatch = {"step": steps, "vlax": ours, "vllm": theirs}
            break
        preemptions += len(ours[1])
        steps += 1
        if steps > 100_000:
            raise RuntimeError(f"{name}: no end after {steps} steps")
    return {
        "case": name,
        "steps": steps,
        "preemptions": preemptions,
        "match": first_mismatch is None,
        "first_mismatch": first_mismatch,
    }


def align_free_order() -> None:
    """Make vLLM free blocks as vlax's pool does: all to the tail, in the order given."""
    from vllm.v1.core.block_pool import BlockPool

    def free_blocks(self, ordered_blocks):
        freed = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    BlockPool.free_blocks = free_blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--align-free-order",
        action="store_true",
        help="only the run with vLLM's free queue aligned to vlax's block pool",
    )
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        pathlib.Path(model_dir, "config.json").write_text(json.dumps(TINY_CONFIG))
        if not args.align_free_order:
            for name in args.cases:
                results[f"{name}/vllm_default"] = compare(name, args.seed, model_dir)
        align_free_order()
        for name in args.cases:
            results[f"{name}/free_order_aligned"] = compare(name, args.seed, model_dir)
    if args.json:
        print(json.dumps(results))
    else:
        for key, row in results.items():
            verdict = "identical" if row["match"] else f"differ: {row['first_mismatch']}"
            print(f"{key}: {row['steps']} steps, {row['preemptions']} preemptions, {verdict}")
    aligned = [row for key, row in results.items() if key.endswith("/free_order_aligned")]
    return 0 if all(row["match"] for row in aligned) else 1


if __name__ == "__main__":
    raise SystemExit(main())
