"""Steps that cannot wedge: failures injected into the real runner and the real detokenizer.

After each failure the core invariants hold, no block leaks, the runner's mirror matches the core,
and the other requests finish with the same tokens as in a clean run. Faults are injected by
wrapping a method of the real component (no stand-in model or runner).
"""

import pytest

from runtime.config import EngineConfig
from runtime.core import scheduler as sched
from runtime.core.kv import kv_cache
from runtime.core.request import SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_state
from runtime.engine import Engine, EngineDeadError
from runtime.runner.errors import RequestFailed
from vlax.default_model import default_model_path

PROMPTS = {
    "a": [1, 40, 41, 42, 43],
    "b": [1, 50, 51, 52, 53, 54, 55, 56, 57, 58],
    "c": [1, 60, 61],
    "d": [1, 70, 71, 72, 73, 74, 75],
}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# No prefix caching: a clean run and a faulty one schedule the same prompts the same way. Small
# blocks: most steps give some request a new block, which a failed step must not give twice.
CONFIG = dict(max_model_len=128, max_num_seqs=8, block_size=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(default_model_path(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def engine(path):
    return Engine(EngineConfig(model=path, **CONFIG))


@pytest.fixture(scope="module")
def clean(engine):
    """Each prompt's tokens and text when nothing fails."""
    return {rid: (c.token_ids, c.text) for rid, c in run(engine, PROMPTS).items()}


def check_in_step(engine):
    """The core invariants, and the runner's mirror agreeing with the core on every running
    request (a failed step must leave neither half-applied)."""
    state = engine.state
    check_state(state)
    for rid in state.running:
        row = engine.runner.rows[rid]
        assert row.block_ids == list(kv_cache.blocks_of(state.kv, rid)), rid
        assert tuple(row.token_ids) == state.requests[rid].all_token_ids, rid


def check_idle(engine):
    check_state(engine.state)
    assert not engine.has_unfinished_requests()
    assert kv_cache.num_free_blocks(engine.state.kv) == engine.runner.num_kv_blocks - 1
    assert not engine.output_processor.requests and not engine.output_processor.samples


def run(engine, prompts, params=PARAMS, finished=None):
    """Add `prompts` (id -> token ids) and step until idle; the completions by id."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    finished = {} if finished is None else finished
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out.outputs[0]
        check_in_step(engine)
    check_idle(engine)
    return finished


class FailingRows:
    """The real runner, whose `execute` fails on its `at_call`-th call while it builds the sampling
    row of `victim`: after it applied the step to its request mirror, before the device step."""

    def __init__(self, runner, victim, at_call, error):
        self.runner, self.victim, self.at_call, self.error = runner, victim, at_call, error
        self.calls = 0
        self.fired = False
        execute, sampling_row = runner.execute, runner._sampling_row

        def counted_execute(so):
            self.calls += 1
            return execute(so)

        def failing_row(row):
            if row.req_id == victim and self.calls == at_call and not self.fired:
                self.fired = True
                raise error
            return sampling_row(row)

        runner.execute, runner._sampling_row = counted_execute, failing_row

    def remove(self):
        del self.runner.execute, self.runner._sampling_row  # back to the class's methods


@pytest.mark.parametrize("at_call", [1, 3], ids=["in-prefill", "in-decode"])
def test_execute_failing_for_one_request_finishes_it_alone(engine, clean, at_call):
    error = RequestFailed(["b"], "request 'b': injected sampler failure")
    fault = FailingRows(engine.runner, "b", at_call, error)
    try:
        got = run(engine, PROMPTS)
    finally:
        fault.remove()
    assert fault.fired
    bad = got["b"]
    assert bad.finish_reason == "error" and "injected sampler failure" in bad.error
    assert bad.token_ids == clean["b"][0][: at_call - 1]
    for rid in ("a", "c", "d"):
        assert (got[rid].token_ids, got[rid].text) == clean[rid], rid
    # The engine goes on serving.
    again = run(engine, PROMPTS)
    assert {rid: (c.token_ids, c.text) for rid, c in again.items()} == clean


def test_execute_failing_without_a_name_keeps_the_state_of_before(engine, clean):
    fault = FailingRows(engine.runner, "c", 3, RuntimeError("injected runner bug"))
    try:
        for rid, ids in PROMPTS.items():
            engine.add_request(rid, ids, PARAMS)
        finished = {}
        while not fault.fired:
            before = engine.state
            try:
                outs = engine.step()
            except RuntimeError as err:
                assert "injected runner bug" in str(err)
                # Nobody was named: the state of before the step is current, nothing half-applied.
                assert engine.state is before
                check_in_step(engine)
                break
            finished.update((o.request_id, o.outputs[0]) for o in outs)
        # The next steps run as if the failed one had never been tried.
        got = run(engine, {}, finished=finished)
    finally:
        fault.remove()
    assert {rid: (c.token_ids, c.text) for rid, c in got.items()} == clean


class FailingDecode:
    """The real tokenizer, failing on its `at_call`-th decode (a detokenizer that raises)."""

    def __init__(self, tokenizer, at_call):
        self.tokenizer, self.at_call, self.calls = tokenizer, at_call, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        if self.calls == self.at_call:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected decode failure")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_failing_detokenizer_ends_only_its_request(engine, clean):
    outputs = engine.output_processor
    real = outputs.tokenizer
    # Only "d"'s detokenizer is built over the failing tokenizer.
    for rid, ids in PROMPTS.items():
        outputs.tokenizer = FailingDecode(real, at_call=6) if rid == "d" else real
        try:
            engine.add_request(rid, ids, PARAMS)
        finally:
            outputs.tokenizer = real
    got = run(engine, {})
    bad = got["d"]
    assert bad.finish_reason == "error" and "injected decode failure" in bad.error
    assert 0 < len(bad.token_ids) < PARAMS.max_tokens
    assert bad.token_ids == clean["d"][0][: len(bad.token_ids)]
    for rid in ("a", "b", "c"):
        assert (got[rid].token_ids, got[rid].text) == clean[rid], rid


def test_abort_in_the_step_a_stop_string_ends_the_request(engine, clean):
    tokens, text = clean["a"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip() and stop in text, text
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    engine.add_request("a", PROMPTS["a"], params)
    for rid in ("b", "c"):
        engine.add_request(rid, PROMPTS[rid], PARAMS)
    stopped = None
    while stopped is None:
        outs = {o.request_id: o.outputs[0] for o in engine.step()}
        check_in_step(engine)
        stopped = outs.get("a")
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.text == text[: text.index(stop)]
    # The caller aborts it in the same step: it already ended, so only "b" is aborted, and "a"
    # is neither reported again nor finished twice in the core.
    aborted = engine.abort_request(["a", "b"])
    assert [(o.request_id, o.outputs[0].finish_reason) for o in aborted] == [("b", "abort")]
    assert engine.state.finished_since_last.count("a") == 1
    assert not sched.has_request(engine.state, "b")
    check_in_step(engine)
    got = run(engine, {})
    assert set(got) == {"c"} and (got["c"].token_ids, got["c"].text) == clean["c"]


def test_a_failure_after_the_device_took_the_cache_ends_the_engine(path):
    engine = Engine(EngineConfig(model=path, **CONFIG))
    logprobs = engine.runner._logprobs

    def failing_logprobs(*args):
        raise RuntimeError("injected failure after the device step")

    engine.runner._logprobs = failing_logprobs
    engine.add_request("a", PROMPTS["a"], SamplingParams(max_tokens=4, logprobs=2))
    with pytest.raises(EngineDeadError, match="injected failure after the device step"):
        engine.step()
    engine.runner._logprobs = logprobs
    # It does not serve from a KV cache in an unknown state.
    with pytest.raises(EngineDeadError, match="stopped serving"):
        engine.step()
