"""The LLM engine's flags (EngineConfig's knobs) and the engine arguments they give, for every
subcommand: `vlax generate` and `vlax batch` take them all; `vlax embed` and `vlax score`
(`pooling=True`) take those that a pooling model uses, and none that only generation needs (KV
cache size, prefix caching and chunked prefill switches, async scheduling)."""

from __future__ import annotations

import argparse

from runtime.config import ATTENTION_BACKENDS, DTYPE_CHOICES


def add_engine_flags(p: argparse.ArgumentParser, pooling: bool = False) -> None:
    p.add_argument(
        "--no-keep-host-buffers",
        action="store_true",
        help="leave glibc malloc's settings alone (by default freed host buffers stay mapped, so "
        "XLA:CPU's per-step buffers are not faulted in again each step)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="dtype of weights and activations; auto: vLLM's choice (a bfloat16 or float16 "
        "checkpoint's own; a float32 one downcast, to float16 for a pooling model, else bfloat16)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="most tokens per input (default: the checkpoint's max_seq_length, else its "
        "max_position_embeddings)"
        if pooling
        else "most tokens (prompt + output) per request (default: the checkpoint's "
        "max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        help=("most inputs in one step" if pooling else "most requests in one step")
        + ", as vLLM's offline LLM (default: 256 per device)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="most tokens in one step (default: vLLM's for an offline LLM, 4096 per device on "
        "the CPU and 8192 on GPUs, at least --max-model-len for a model that computes each "
        "input whole, at most --max-num-seqs whole inputs)"
        if pooling
        else "most tokens in one step (default: vLLM's for an offline LLM, 4096 per device on "
        "the CPU and 8192 on GPUs; without chunked prefill at least --max-model-len; at most "
        "--max-num-seqs whole requests)",
    )
    if not pooling:
        p.add_argument(
            "--num-kv-blocks",
            type=int,
            help="KV cache size in blocks (default: room for --max-num-seqs requests of "
            "--max-model-len tokens, within a memory budget)",
        )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: the Pallas kernel where it runs (GPUs), else the reference (plain JAX)",
    )
    if not pooling:
        p.add_argument(
            "--no-prefix-caching",
            action="store_true",
            help="recompute shared prompt prefixes instead of reusing their KV cache",
        )
        p.add_argument(
            "--no-chunked-prefill",
            action="store_true",
            help="prefill each prompt in a single step",
        )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="engine seed" if pooling else "engine seed, for prompts without a seed",
    )
    if not pooling:
        p.add_argument(
            "--max-logprobs",
            type=int,
            default=20,
            help="most top logprobs a request may ask for (-1: the whole vocabulary)",
        )
        p.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="schedule the next step while the device runs this one (vLLM's async "
            "scheduling; default: the engine's choice)",
        )


def engine_args(args: argparse.Namespace, pooling: bool = False) -> dict:
    """The LLM / EngineConfig keyword arguments of the flags `add_engine_flags` added."""
    common = dict(
        keep_host_buffers=not args.no_keep_host_buffers,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )
    if pooling:
        return common
    return dict(
        common,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        async_scheduling=args.async_scheduling,
        max_logprobs=args.max_logprobs,
    )
