"""Checks for tests of the KV offload through a whole engine (of runtime/ and of vlax/)."""

from __future__ import annotations

from collections.abc import Callable


def check_store_then_load(
    llm, run: Callable, baseline: list, *, stored: int, loaded: int, prefilled: int
) -> None:
    """`run(llm)` twice on an engine with a KV store: the first pass stores `stored` blocks, the
    second loads `loaded` of them back and prefills only `prefilled` tokens; both give `baseline`,
    and nothing failed on the way."""
    first = run(llm)
    assert first == baseline, f"first pass: {first} != {baseline}"
    stats = llm.engine.offload_stats
    assert stats.blocks_stored == stored, f"stored {stats.blocks_stored} blocks, want {stored}"
    first_step = len(llm.engine.stats)
    second = run(llm)
    assert second == baseline, f"second pass: {second} != {baseline}"
    stats = llm.engine.offload_stats
    assert stats.blocks_loaded == loaded, f"loaded {stats.blocks_loaded} blocks, want {loaded}"
    prefill = sum(s.num_prefill_tokens for s in llm.engine.stats[first_step:])
    assert prefill == prefilled, f"second pass prefilled {prefill} tokens, want {prefilled}"
    assert (stats.load_failures, stats.store_failures) == (0, 0), stats
    assert llm.engine.offloader.errors == [], llm.engine.offloader.errors
