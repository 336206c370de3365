"""The engine against a real Mooncake pool, run as
`unshare -n python3 tests/runtime/offload/mooncake_engine_scenario.py`.

Inside a private network namespace (see mooncake_scenario.py for why) it starts mooncake_master,
then: an engine with kv_offload="mooncake" serves prompts twice and its second pass loads their
prefixes from the pool with the same greedy tokens as an engine without offload; a second engine
(a new LLM on the same checkpoint) finds the first one's stored prefixes in the shared pool and
computes only what a hit leaves. The master is stopped by its pid; any failed check exits non-zero.
Workload and counts as in test_offload_end_to_end.py.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

from mooncake_scenario import MASTER, check_private_network, start_master, stop_master  # noqa: E402

NUM_PROMPTS, PROMPT_LEN, BLOCK, MAX_TOKENS = 6, 40, 4, 4
FULL_BLOCKS = (PROMPT_LEN + MAX_TOKENS - 1) // BLOCK
HIT_BLOCKS = (PROMPT_LEN - 1) // BLOCK
# record_steps=None: the checks read every step's stats and scheduler output.
ENGINE = dict(
    max_model_len=64, block_size=BLOCK, num_kv_blocks=24, max_num_seqs=2, record_steps=None
)


def run_pass(llm, prompts) -> tuple[list, int]:
    """Greedy tokens of each prompt, and the prefill tokens the engine computed for them."""
    from runtime.core.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first_step = len(llm.engine.stats)
    outs = llm.generate(prompts, params, use_tqdm=False)
    prefill = sum(s.num_prefill_tokens for s in llm.engine.stats[first_step:])
    return [o.outputs[0].token_ids for o in outs], prefill


def trace(llm) -> str:
    """Per step: scheduled tokens and the KV jobs started, for a failure message."""
    return "\n".join(
        f"{so.step}: {dict(so.num_scheduled_tokens)} pre {so.preempted_req_ids} "
        f"{[(type(j).__name__, j.req_id, len(j.block_ids)) for j in so.kv_jobs]}"
        for so in llm.engine.history
    )


def check_hits(llm, prefill: int) -> None:
    """Every repeated prompt loaded its stored prefix. Exactly 24 prefill tokens when each load
    ends before the next is planned; a load that ends while a later one is planned can lose some
    of its freshly loaded blocks to that later allocation (they sit in the free queue until the
    request is admitted again), and then those tokens are computed: more prefill, same tokens."""
    stats = llm.engine.offload_stats
    assert stats.blocks_loaded >= NUM_PROMPTS * HIT_BLOCKS, stats
    assert stats.hit_tokens == stats.blocks_loaded * BLOCK, stats
    assert prefill >= NUM_PROMPTS * (PROMPT_LEN - HIT_BLOCKS * BLOCK), trace(llm)
    assert prefill < NUM_PROMPTS * PROMPT_LEN, trace(llm)


def connect_engine(checkpoint):
    """An LLM on the Mooncake pool, retried while the fresh master is still coming up."""
    import time

    from runtime.offload.store import StoreError
    from vlax import LLM

    deadline = time.monotonic() + 120  # bounds a master that never comes up
    while True:
        try:
            return LLM(
                checkpoint,
                **ENGINE,
                kv_offload="mooncake",
                kv_offload_bytes=16 << 20,
                mooncake_master=MASTER,
            )
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def check_engines(checkpoint) -> None:
    import numpy as np

    from vlax import LLM

    rng = np.random.default_rng(7)
    prompts = [
        {"prompt_token_ids": rng.integers(3, 128, PROMPT_LEN).tolist()} for _ in range(NUM_PROMPTS)
    ]
    baseline, prefill = run_pass(LLM(checkpoint, **ENGINE), prompts)
    assert prefill == NUM_PROMPTS * PROMPT_LEN, prefill

    first = connect_engine(checkpoint)
    try:
        assert run_pass(first, prompts) == (baseline, NUM_PROMPTS * PROMPT_LEN)
        assert first.engine.offload_stats.blocks_stored == NUM_PROMPTS * FULL_BLOCKS
        got, prefill = run_pass(first, prompts)
        stats = first.engine.offload_stats
        assert got == baseline
        check_hits(first, prefill)
        assert stats.load_failures == stats.store_failures == 0, first.engine.offloader.errors
        print(f"engine ok: second pass prefill {prefill} of {NUM_PROMPTS * PROMPT_LEN}, {stats}")

        # The first engine stays up: its client's segment holds part of the pool.
        second = connect_engine(checkpoint)
        try:
            got, prefill = run_pass(second, prompts)
            stats = second.engine.offload_stats
            assert got == baseline
            check_hits(second, prefill)
            assert stats.blocks_stored == 0, stats  # it found every full block already there
            print(f"shared pool ok: a new engine computed {prefill} prefill tokens, {stats}")
        finally:
            second.engine.close()
    finally:
        first.engine.close()


def main() -> int:
    from model.testing import write_tiny_checkpoint

    check_private_network()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_checkpoint(os.path.join(tmp, "llama"), "llama", seed=1)
        master = start_master()
        try:
            check_engines(checkpoint)
        finally:
            stop_master(master)
    print("MOONCAKE ENGINE SCENARIO PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
