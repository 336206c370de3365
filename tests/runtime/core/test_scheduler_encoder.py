"""Encoder inputs in the schedule: when they run, budgets, cache capacity and sharing."""

from scheduler_driver import add, make, request, run, schedule, step

from runtime.core.encoder import encoder_cache as ec
from runtime.core.request import MultiModalInput


def _mm(*items):
    return tuple(MultiModalInput(h, offset, n) for h, offset, n in items)


def test_an_input_runs_in_the_step_whose_tokens_reach_it_and_is_released_after():
    state = add(make(), request("a", 40, 1, mm=_mm(("X", 33, 6))))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 32} and dict(out.scheduled_encoder_inputs) == {}
    scheduled, out = schedule(state)
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    assert scheduled.encoder.entries["X"].refs == {("a", 0)}
    state, _, _ = step(state)
    # Finished: the entry stays cached but unreferenced (freeable).
    assert state.encoder.freeable == ("X",) and ec.is_cached(state.encoder, "X")


def test_a_chunk_stops_before_an_input_over_the_encoder_budget():
    state = make(encoder_compute_budget=8)
    state = add(state, request("a", 30, 1, mm=_mm(("X", 2, 8), ("Y", 12, 8))))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 12}
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 18}
    assert dict(out.scheduled_encoder_inputs) == {"a": (1,)}


def test_an_input_may_span_chunks_when_it_is_computed_in_the_first():
    state = add(make(max_num_batched_tokens=8), request("a", 20, 1, mm=_mm(("X", 4, 8))))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 8} and dict(out.scheduled_encoder_inputs) == {}
    assert not state.encoder.entries["X"].refs  # released once computed tokens passed its end


def test_a_full_cache_delays_an_input_until_space_is_freeable():
    state = make(encoder_cache_size=8, encoder_compute_budget=16)
    state = add(
        state, request("a", 12, 3, mm=_mm(("X", 0, 8))), request("b", 12, 1, mm=_mm(("Y", 2, 8)))
    )
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 12, "b": 2}
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 10}
    assert dict(out.scheduled_encoder_inputs) == {"b": (0,)}
    assert out.free_encoder_hashes == ("X",)


def test_one_encoder_output_is_shared_by_requests_and_repeats():
    state = make()
    state = add(
        state,
        request("a", 12, 1, mm=_mm(("X", 0, 4), ("X", 6, 4))),
        request("b", 12, 1, mm=_mm(("X", 4, 4))),
    )
    scheduled, out = schedule(state)
    assert dict(out.scheduled_encoder_inputs) == {"a": (0,)}
    assert scheduled.encoder.entries["X"].refs == {("a", 0), ("a", 1), ("b", 0)}
    state, _, _ = run(state)
    state = add(state, request("c", 8, 1, mm=_mm(("X", 2, 4))))
    scheduled, out = schedule(state)
    assert dict(out.scheduled_encoder_inputs) == {} and out.num_scheduled_tokens["c"] == 8
