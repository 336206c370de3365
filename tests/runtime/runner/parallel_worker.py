"""Runs tensor-parallel engines in a fresh process for tests/runtime/runner/test_tensor_parallel.py.

JAX sees as many CPU devices as `--xla_force_host_platform_device_count` gives it only if the flag
is set before JAX starts, so the tests run this file as a subprocess with XLA_FLAGS set, and read
the one JSON line it prints last.

    python parallel_worker.py engines CASES_JSON
        # {"engines": {name: [checkpoint, [tp, ...], ep(, backend, max_tokens)]},
        #  "refusals": {name: [checkpoint, tp, ep]}}
    python parallel_worker.py host CHECKPOINT TP PROMPT_SHIFT   # one process of a group (env)
"""

from __future__ import annotations

import json
import sys

PROMPTS = [[5, 9, 23, 41, 7, 3, 88], [17, 4, 60, 33], [101, 12, 19, 77, 54, 6, 31, 8, 90, 45]]
ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=4, num_kv_blocks=40)
MAX_TOKENS = 8


def generate(llm, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from runtime.core.request import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def layout(runner) -> dict:
    """Bytes per device, and the whole bytes of the split and the replicated arrays."""
    import jax

    from runtime.runner.parallel import bytes_per_device

    def whole(tree, split: bool) -> int:
        return sum(
            leaf.nbytes
            for leaf in jax.tree_util.tree_leaves(tree)
            if (not leaf.sharding.is_fully_replicated) == split
        )

    return {
        "weights_per_device": sorted(set(bytes_per_device(runner.params).values())),
        "weights_split": whole(runner.params, True),
        "weights_replicated": whole(runner.params, False),
        "kv_per_device": sorted(set(bytes_per_device(runner.kv_caches).values())),
        "kv_split": whole(runner.kv_caches, True),
        "kv_replicated": whole(runner.kv_caches, False),
    }


def engines(cases: dict) -> dict:
    from vlax import LLM

    out = {}
    for name, (path, sizes, expert_parallel, *short) in cases.items():
        # A short case ([..., backend, max_tokens]) runs the first prompt only.
        backend, max_tokens = short if short else ("auto", MAX_TOKENS)
        for tp in sizes:
            llm = LLM(
                path,
                dtype="float32",
                tensor_parallel_size=tp,
                enable_expert_parallel=expert_parallel,
                attention_backend=backend,
                **ENGINE,
            )
            out[f"{name} tp={tp}"] = {
                "tokens": generate(llm, PROMPTS[:1] if short else PROMPTS, max_tokens),
                **layout(llm.engine.runner),
            }
            del llm
    return out


def refusals(cases: dict) -> dict:
    from vlax import LLM

    out = {}
    for name, (path, tp, expert_parallel) in cases.items():
        try:
            LLM(
                path,
                dtype="float32",
                tensor_parallel_size=tp,
                enable_expert_parallel=expert_parallel,
                **ENGINE,
            )
            out[name] = None
        except Exception as err:  # noqa: BLE001 (the test reads the type and message)
            out[name] = f"{type(err).__name__}: {err}"
    return out


def host(path: str, tp: int, shift: int) -> dict:
    """One process of a multi-host engine; `shift` != 0 changes its first prompt (a divergence)."""
    import jax

    from vlax import LLM

    prompts = [list(p) for p in PROMPTS]
    prompts[0][0] += shift
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, **ENGINE)
    result = {"process": jax.process_index(), "devices": jax.device_count()}
    try:
        result["tokens"] = generate(llm, prompts)
    except Exception as err:  # noqa: BLE001
        result["error"] = f"{type(err).__name__}: {err}"
    return result


def main() -> None:
    mode = sys.argv[1]
    if mode == "engines":
        cases = json.loads(sys.argv[2])
        result = {"engines": engines(cases["engines"]), "refusals": refusals(cases["refusals"])}
    elif mode == "host":
        result = host(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    # One write, line and newline together: with PYTHONUNBUFFERED print() writes the two
    # apart, and Gloo's C++ side once wrote its own line between them.
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
