"""Async scheduling (EngineConfig.async_scheduling) through the real engine, runner and model.

Step N+1 is scheduled and dispatched while step N runs, its requests' last tokens placeholders fed
by the device. The tokens must be those of synchronous scheduling (and of HF transformers) for
greedy and seeded sampling, through chunked prefill, prefix hits, preemption and aborts with a
step in flight; a failure while N+1 is dispatched with N in flight must lose nothing of N.
"""

import numpy as np
import pytest

from model.testing import check_logprobs_close, hf_greedy, hf_load, write_tiny_checkpoint
from runtime.config import ConfigError, EngineConfig
from runtime.core import scheduler as sched
from runtime.core.kv import kv_cache
from runtime.core.request import SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_state
from runtime.engine import Engine, EngineDeadError
from runtime.runner.errors import RequestFailed
from vlax import LLM

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# 17 blocks of 4 tokens cannot hold six ~35-token sequences (preemption); a 16-token budget
# chunks the long prompts between decodes; the shared 12-token prefix hits the prefix cache.
LLM_CONFIG = dict(
    max_model_len=64, max_num_seqs=6, max_num_batched_tokens=16, block_size=4, num_kv_blocks=17
)
ENGINE_CONFIG = dict(max_model_len=128, max_num_seqs=8, block_size=4, enable_prefix_caching=False)
PROMPTS = {
    "a": [1, 40, 41, 42, 43],
    "b": [1, 50, 51, 52, 53, 54, 55, 56, 57, 58],
    "c": [1, 60, 61],
    "d": [1, 70, 71, 72, 73, 74, 75],
}


def _prompts(seed, lengths, prefix_len=12, vocab=128):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, prefix_len).tolist()
    return [prefix + rng.integers(3, vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", "llama", seed=1)


def _calls(runner):
    """Record the runner's dispatch / collect calls by step, through the real methods."""
    calls = []
    dispatch, collect = runner.dispatch, runner.collect

    def recorded_dispatch(so):
        calls.append(("dispatch", so.step))
        return dispatch(so)

    def recorded_collect(step):
        calls.append(("collect", step.step))
        return collect(step)

    runner.dispatch, runner.collect = recorded_dispatch, recorded_collect
    return calls


def _completions(outputs):
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs or ()])
        for o in outputs
        for c in o.outputs
    ]


def test_async_tokens_equal_sync_and_hf_greedy_and_seeded_with_preemption(llama):
    prompts = [{"prompt_token_ids": p} for p in _prompts(11, [5, 9, 23, 2, 21, 7])]
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=MAX_TOKENS, logprobs=1)
        for i in range(len(prompts))
    ]
    # Penalties read the tokens themselves: those steps wait for the one before.
    penalised = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=MAX_TOKENS,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        ignore_eos=True,
    )
    runs = {}
    for mode in (False, True):
        llm = LLM(llama, dtype="float32", async_scheduling=mode, record_steps=None, **LLM_CONFIG)
        assert llm.engine.async_scheduling is mode
        calls = _calls(llm.engine.runner)
        runs[mode] = [
            _completions(llm.generate(prompts, params, use_tqdm=False))
            for params in (GREEDY, seeded, penalised)
        ]
        stats = llm.engine.stats
        assert sum(s.num_preempted for s in stats) > 0, mode
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats), mode
        hits = [nd.num_computed_tokens for so in llm.engine.history for nd in so.scheduled_new_reqs]
        assert max(hits) >= 12, mode
        overlapped = [
            step
            for i, (kind, step) in enumerate(calls)
            if kind == "dispatch" and ("collect", step - 1) in calls[i + 1 :]
        ]
        # Async: steps are dispatched before the one before them is read back; sync: never.
        assert bool(overlapped) is mode, (mode, calls[:12])
        assert not llm.engine.has_unfinished_requests()
    for sync_run, async_run in zip(runs[False], runs[True], strict=True):
        assert [c[0] for c in async_run] == [c[0] for c in sync_run]
        # Another batch composition (async plans a finishing request's step once more) may
        # round differently; the tokens may not differ.
        if sync_run[0][1]:  # the penalised run asks for no logprobs
            check_logprobs_close(async_run, sync_run, atol=1e-4)
    model = hf_load(llama)
    reference = [hf_greedy(model, p["prompt_token_ids"], MAX_TOKENS) for p in prompts]
    assert [c[0] for c in runs[True][0]] == reference


# -- the engine, step by step ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(llama):
    return Engine(
        EngineConfig(dtype="float32", model=llama, async_scheduling=True, **ENGINE_CONFIG)
    )


@pytest.fixture(scope="module")
def clean(llama):
    """Each prompt's tokens when nothing fails, scheduled synchronously."""
    sync = Engine(
        EngineConfig(dtype="float32", model=llama, async_scheduling=False, **ENGINE_CONFIG)
    )
    return {rid: c.token_ids for rid, c in run(sync, PROMPTS).items()}


def check_in_step(engine):
    """The core invariants, and the runner's mirror agreeing with the core on every running
    request: the same blocks, and the core's tokens followed by at most the two steps in flight's."""
    state = engine.state
    check_state(state)
    for rid in state.running:
        row = engine.runner.rows[rid]
        assert row.block_ids == list(kv_cache.blocks_of(state.kv, rid)), rid
        known = state.requests[rid].all_token_ids
        assert tuple(row.token_ids[: len(known)]) == known, rid
        assert len(row.token_ids) - len(known) <= len(engine._in_flight), rid


def check_idle(engine):
    check_state(engine.state)
    assert not engine.has_unfinished_requests() and not engine._in_flight
    assert kv_cache.num_free_blocks(engine.state.kv) == engine.runner.num_kv_blocks - 1
    assert not engine.output_processor.requests and not engine.output_processor.samples


def run(engine, prompts, finished=None):
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished = {} if finished is None else finished
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished, out.request_id
            finished[out.request_id] = out.outputs[0]
        check_in_step(engine)
    check_idle(engine)
    return finished


class FailingDispatch:
    """The real runner, whose `dispatch` fails on its `at_call`-th call while it builds the
    sampling row of `victim`: after it applied the step to its mirror, before the device step,
    with the step before still in flight."""

    def __init__(self, runner, victim, at_call, error):
        self.runner, self.fired, self.calls = runner, False, 0
        dispatch, sampling_row = runner.dispatch, runner._sampling_row

        def counted_dispatch(so):
            self.calls += 1
            return dispatch(so)

        def failing_row(row):
            if row.req_id == victim and self.calls == at_call and not self.fired:
                assert runner._unread is not None  # the step before is in flight
                self.fired = True
                raise error
            return sampling_row(row)

        runner.dispatch, runner._sampling_row = counted_dispatch, failing_row

    def remove(self):
        del self.runner.dispatch, self.runner._sampling_row


@pytest.mark.parametrize("at_call", [2, 4], ids=["first-decode", "later-decode"])
def test_dispatch_failing_for_one_request_with_a_step_in_flight_finishes_it_alone(
    engine, clean, at_call
):
    fault = FailingDispatch(
        engine.runner, "b", at_call, RequestFailed(["b"], "request 'b': injected failure")
    )
    try:
        got = run(engine, PROMPTS)
    finally:
        fault.remove()
    assert fault.fired
    bad = got["b"]
    assert bad.finish_reason == "error" and "injected failure" in bad.error
    # Its tokens up to the failure, none lost and none invented: a prefix of the clean run's.
    assert bad.token_ids == clean["b"][: len(bad.token_ids)] and len(bad.token_ids) < 8
    for rid in ("a", "c", "d"):
        assert got[rid].token_ids == clean[rid], rid
    again = run(engine, PROMPTS)
    assert {rid: c.token_ids for rid, c in again.items()} == clean


def test_dispatch_failing_without_a_name_keeps_the_state_of_before(engine, clean):
    fault = FailingDispatch(engine.runner, "c", 3, RuntimeError("injected runner bug"))
    finished = {}
    try:
        for rid, ids in PROMPTS.items():
            engine.add_request(
                rid, ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            )
        while not fault.fired:
            before = engine.state
            try:
                outs = engine.step()
            except RuntimeError as err:
                assert "injected runner bug" in str(err)
                # The step in flight is still queued, and nothing of the failed one was applied.
                assert engine.state is before and len(engine._in_flight) == 1
                check_in_step(engine)
                break
            finished.update((o.request_id, o.outputs[0]) for o in outs)
        got = run(engine, {}, finished=finished)
    finally:
        fault.remove()
    assert {rid: c.token_ids for rid, c in got.items()} == clean


def test_abort_with_steps_in_flight_reports_once_and_keeps_the_others(engine, clean):
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished = {}
    for _ in range(4):
        finished.update((o.request_id, o.outputs[0]) for o in engine.step())
    assert engine._in_flight, "a step is in flight when the caller aborts"
    aborted = engine.abort_request(["b", "a"])
    assert sorted((o.request_id, o.outputs[0].finish_reason) for o in aborted) == [
        ("a", "abort"),
        ("b", "abort"),
    ]
    assert all(
        o.outputs[0].token_ids == clean[o.request_id][: len(o.outputs[0].token_ids)]
        for o in aborted
    )
    assert not sched.has_request(engine.state, "a") and not sched.has_request(engine.state, "b")
    check_in_step(engine)
    # The aborted ids are free at once: a new request under one of them runs from its prompt.
    got = run(engine, {"a": PROMPTS["a"]}, finished=finished)
    assert set(got) == {"a", "c", "d"}
    assert {rid: got[rid].token_ids for rid in got} == {r: clean[r] for r in ("a", "c", "d")}


def test_a_failure_reading_the_step_back_ends_the_engine(llama):
    engine = Engine(
        EngineConfig(dtype="float32", model=llama, async_scheduling=True, **ENGINE_CONFIG)
    )

    def failing_logprobs(*args):
        raise RuntimeError("injected failure reading the step")

    engine.runner._logprobs = failing_logprobs
    engine.add_request("a", PROMPTS["a"], SamplingParams(max_tokens=4, logprobs=2))
    with pytest.raises(EngineDeadError, match="injected failure reading the step"):
        while True:
            engine.step()
    with pytest.raises(EngineDeadError, match="stopped serving"):
        engine.step()


def test_async_scheduling_refused_by_name_where_it_cannot_run(llama):
    with pytest.raises(ConfigError, match="async_scheduling=True .*pooling model"):
        Engine(EngineConfig(dtype="float32", model=llama, runner="pooling", async_scheduling=True))
    with pytest.raises(ConfigError, match="async_scheduling=True .*kv_offload"):
        Engine(EngineConfig(dtype="float32", model=llama, kv_offload="host", async_scheduling=True))
    with pytest.raises(ConfigError, match="async_scheduling must be True, False or None"):
        EngineConfig(dtype="float32", model=llama, async_scheduling="yes")


def test_hybrid_state_slots_async_tokens_equal_sync_with_preemption(tmp_path):
    """Kimi-Linear keeps recurrent state in slots the core hands out; async scheduling reuses a
    preempted request's slot while its last step may still be in flight."""
    path = write_tiny_checkpoint(tmp_path / "kimi", "kimi_linear", seed=3)
    rng = np.random.default_rng(21)
    lengths = (1, 6, 13, 22, 9, 30)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, n).tolist()} for n in lengths]
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True)
    # 12 usable blocks of 4 cannot hold three of the longer sequences: requests get preempted.
    config = dict(
        max_model_len=48,
        block_size=4,
        max_num_seqs=3,
        num_kv_blocks=13,
        max_num_batched_tokens=16,
        record_steps=None,
    )
    runs = {}
    for mode in (False, True):
        llm = LLM(path, dtype="float32", async_scheduling=mode, **config)
        assert llm.engine.runner.num_state_slots == 3
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[mode] = [o.outputs[0].token_ids for o in outputs]
        assert sum(s.num_preempted for s in llm.engine.stats) > 0, mode
    assert runs[True] == runs[False]
