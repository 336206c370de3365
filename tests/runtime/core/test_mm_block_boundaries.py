"""Multimodal spans whose edges fall exactly on block and chunk boundaries, through the core:
which blocks the span keys, where prefix hits stop, which step runs (and releases) the encoder
input, and where a chunk is cut. Off-by-one slips at these edges (a span ending at a block start
still keying that block, an input starting at a chunk's end run one step early) pass every test
whose spans sit inside blocks."""

from scheduler_driver import add, make, request, run, schedule, step

from runtime.core.kv import kv_cache as kvc
from runtime.core.kv.block_hash import HashExtras, extend_block_hashes
from runtime.core.request import MultiModalInput

BLOCK = 4
PROMPT = tuple(range(50, 70))  # 20 tokens: five full blocks


def _mm(*items):
    return tuple(MultiModalInput(h, offset, n) for h, offset, n in items)


def test_a_span_filling_one_block_keys_that_block_only():
    # Image X covers tokens 8..11: it starts at block 2's start and ends at its end.
    state = add(make(), request("a", PROMPT, 1, mm=_mm(("X", 8, 4))))
    hashes = state.requests["a"].block_hashes
    plain = extend_block_hashes((), PROMPT, BLOCK)
    assert len(hashes) == 5
    assert hashes[:2] == plain[:2]  # the span starts at block 2: blocks 0 and 1 are plain text
    assert hashes[2] != plain[2]
    # Block 3 starts where the span ends: keyed by nothing but its tokens and its parent.
    assert extend_block_hashes(hashes[:3], PROMPT, BLOCK) == hashes
    assert hashes == extend_block_hashes((), PROMPT, BLOCK, HashExtras(mm_spans=(("X", 8, 4),)))


def test_prefix_hits_stop_exactly_at_the_block_an_other_image_starts():
    state = add(make(), request("a", PROMPT, 1, mm=_mm(("X", 8, 4))))
    state, _, _ = run(state)
    # Same tokens, another image in the same placeholder: blocks 0 and 1 hit, block 2 misses,
    # and the new image runs in the first step, which starts at its offset.
    state = add(state, request("b", PROMPT, 1, mm=_mm(("Y", 8, 4))))
    assert kvc.find_cached_prefix(state.kv, state.requests["b"]).num_tokens == 8
    scheduled, out = schedule(state)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 12
    assert dict(out.scheduled_encoder_inputs) == {"b": (0,)}
    state, _, _ = run(state)
    # Same tokens, same image: the hit covers the image (N-1 rule: 16 of 20 tokens), so its
    # encoder output is neither computed nor referenced again.
    state = add(state, request("c", PROMPT, 1, mm=_mm(("X", 8, 4))))
    scheduled, out = schedule(state)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 16 and out.num_scheduled_tokens["c"] == 4
    assert dict(out.scheduled_encoder_inputs) == {}
    assert scheduled.encoder.entries["X"].refs == frozenset()
    state, _, _ = run(state)
    # Plain text with the same ids: only the blocks before the image are shared.
    state = add(state, request("d", PROMPT, 1))
    assert kvc.find_cached_prefix(state.kv, state.requests["d"]).num_tokens == 8


def test_an_input_starting_at_a_chunk_end_runs_in_the_next_chunk():
    # 8-token chunks: X (8..11) starts exactly where chunk 1 ends; Y (16..19) where chunk 2 ends.
    state = make(max_num_batched_tokens=8)
    state = add(state, request("a", PROMPT + (7, 7, 7, 7), 1, mm=_mm(("X", 8, 4), ("Y", 16, 4))))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    assert dict(out.scheduled_encoder_inputs) == {} and not state.encoder.entries
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    # X ended at 12 and 16 tokens are computed: released; Y not touched yet.
    assert state.encoder.entries["X"].refs == frozenset() and "Y" not in state.encoder.entries
    state, out, _ = step(state)
    assert dict(out.scheduled_encoder_inputs) == {"a": (1,)}


def test_an_input_ending_at_a_chunk_end_is_released_by_that_step():
    state = make(max_num_batched_tokens=12)
    state = add(state, request("a", PROMPT, 1, mm=_mm(("X", 8, 4))))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 12}
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    # 12 tokens computed, exactly X's end: nothing of X is left to compute, so nothing holds it.
    assert state.encoder.entries["X"].refs == frozenset()
    scheduled, out = schedule(state)
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    assert dict(out.scheduled_encoder_inputs) == {}
    assert scheduled.encoder.entries["X"].refs == frozenset()


def test_the_encoder_budget_cuts_a_chunk_exactly_between_adjacent_spans():
    # X (8..11) and Y (12..15) touch at block 3's start; the budget encodes one of them per step.
    state = make(encoder_compute_budget=4)
    state = add(state, request("a", PROMPT, 1, mm=_mm(("X", 8, 4), ("Y", 12, 4))))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 12}
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    assert dict(out.scheduled_encoder_inputs) == {"a": (1,)}
