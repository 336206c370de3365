"""Output processor over the real core scheduler and the real tokenizer: stop strings end a request
in the step they appear, the stopping token's text is left out, samples gather into one output, and
a failing detokenizer ends only its own request. Tokens are scripted per request (no model)."""

import dataclasses

import pytest

from model.config import ModelConfig
from runtime.core import scheduler as sched
from runtime.core.devtools.synthetic_runner import runner_output
from runtime.core.kv import kv_cache
from runtime.core.request import FinishReason, SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_state
from runtime.input_processor import InputProcessor
from runtime.output_processor import OutputProcessor
from runtime.tokenizer import Tokenizer
from vlax.default_model import default_model_path

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return default_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def model_config(path):
    # A second EOS id (7), as Llama 3's generation_config.json lists <|eot_id|> beside </s>.
    return dataclasses.replace(ModelConfig.from_pretrained(path), eos_token_ids=(2, 7))


class Run:
    """The core scheduler, scripted tokens and one OutputProcessor, stepped like the engine."""

    def __init__(self, model_config, tokenizer, scripts):
        self.inputs = InputProcessor(model_config, tokenizer, max_model_len=128)
        self.outputs = OutputProcessor(tokenizer)
        self.scripts = scripts  # core request id -> the tokens it samples, in order
        self.state = sched.make_scheduler(
            sched.SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=64,
                max_model_len=128,
                block_size=4,
                num_blocks=NUM_BLOCKS,
            )
        )
        self.finished = {}
        self.steps = 0

    def add(self, request_id, prompt, params):
        processed = self.inputs.process(request_id, prompt, params)
        for child in processed.children:
            self.state = sched.add_request(self.state, child)
        self.outputs.add(processed)

    def step(self):
        scheduled, so = sched.schedule(self.state)
        mro = runner_output(
            scheduled, so, lambda r: self.scripts[r.request_id][r.num_output_tokens]
        )
        updated, outs = sched.update(scheduled, so, mro)
        self.state, done = self.outputs.process(scheduled, updated, outs)
        check_state(self.state)
        self.steps += 1
        for out in done:
            self.finished[out.request_id] = out
        return done

    def run(self):
        while sched.has_unfinished_requests(self.state):
            self.step()
        # Nothing leaked: every block is back in the pool, nothing is tracked.
        assert kv_cache.num_free_blocks(self.state.kv) == NUM_BLOCKS - 1
        assert not self.outputs.samples and not self.outputs.requests
        return self.finished


def test_a_stop_string_ends_the_request_in_the_step_it_appears(model_config, tok):
    ids = tok.encode(
        "Hello world, the robot stop here and then more words", add_special_tokens=False
    )
    run = Run(model_config, tok, {"s": ids, "other": ids})
    run.add("s", [1, 5, 6], SamplingParams(max_tokens=len(ids), stop=["stop here"]))
    run.add("other", [1, 5, 6], SamplingParams(max_tokens=len(ids)))
    done = []
    while not done:
        done = run.step()
    (out,) = done
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "stop here"
    assert c.text == "Hello world, the robot "
    # It left the core in the same step: no block, no entry, and the next schedule tells the runner.
    assert not sched.has_request(run.state, "s") and "s" in run.state.finished_since_last
    assert c.token_ids == list(ids[: len(c.token_ids)]) and len(c.token_ids) < len(ids)
    assert run.outputs.samples_of(["s"]) == []  # an abort now finds nothing to end
    rest = run.run()
    assert rest["other"].outputs[0].text == tok.decode(ids)
    assert rest["other"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_the_stopping_tokens_text_is_left_out(model_config, tok, include):
    text = tok.encode("Hi there", add_special_tokens=False)
    stop_id = tok.encode(" friend", add_special_tokens=False)[-1]
    scripts = {"eos": [*text, 2, 9], "eot": [*text, 7, 9], "stop_id": [*text, stop_id, 9]}
    run = Run(model_config, tok, scripts)
    params = dict(max_tokens=8, skip_special_tokens=False, include_stop_str_in_output=include)
    run.add("eos", [1, 5], SamplingParams(**params))
    run.add("eot", [1, 5], SamplingParams(**params))
    run.add("stop_id", [1, 5], SamplingParams(stop_token_ids=[stop_id], **params))
    finished = run.run()
    for rid, stop_reason in (("eos", None), ("eot", 7), ("stop_id", stop_id)):
        c = finished[rid].outputs[0]
        tokens = scripts[rid][: len(text) + 1]
        # The stopping token stays in token_ids; its text only with include_stop_str_in_output.
        assert c.token_ids == tokens
        assert (c.finish_reason, c.stop_reason) == ("stop", stop_reason)
        shown = tokens if include else tokens[:-1]
        assert c.text == tok.decode(shown, skip_special_tokens=False), rid
    assert "</s>" not in finished["eos"].outputs[0].text or include


def test_min_tokens_keeps_every_eos_id_from_stopping(model_config, tok):
    run = Run(model_config, tok, {"r": [7, 2, 5, 7, 9]})
    run.add("r", [1, 5], SamplingParams(min_tokens=3, max_tokens=5))
    c = run.run()["r"].outputs[0]
    # EOS ids before min_tokens do not stop (the sampler masks them; here they were forced).
    assert c.token_ids == [7, 2, 5, 7] and c.stop_reason == 7


def test_samples_of_a_request_come_out_together(model_config, tok):
    run = Run(model_config, tok, {"r.0": [5, 2], "r.1": [5, 6, 8, 9]})
    run.add("r", [1, 5], SamplingParams(n=2, max_tokens=4, logprobs=None))
    done = []
    while not done:
        done = run.step()
    assert run.steps == 4  # not before the longer sample is done
    (out,) = done
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [[5, 2], [5, 6, 8, 9]]
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    run.run()


class PoisonedTokenizer:
    """The real tokenizer, except that decoding `poison` raises (a detokenizer failing)."""

    def __init__(self, tokenizer, poison):
        self.tokenizer, self.poison = tokenizer, poison

    def decode(self, ids, skip_special_tokens=True):
        if self.poison in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_failing_detokenizer_ends_only_its_request(model_config, tok):
    poison = 77
    scripts = {
        "a": [10, 11, 12, 13, 14, 15],
        "bad": [10, 11, poison, 13, 14, 15],
        "b": [20, 21, 22, 23, 24, 25],
    }
    params = SamplingParams(max_tokens=6)
    clean = Run(model_config, tok, scripts)
    faulty = Run(model_config, PoisonedTokenizer(tok, poison), scripts)
    for run in (clean, faulty):
        for rid in scripts:
            run.add(rid, [1, 5, 6], params)
    want, got = clean.run(), faulty.run()
    bad = got["bad"].outputs[0]
    assert bad.finish_reason == "error" and "poisoned token" in bad.error
    assert bad.token_ids == [10, 11, poison] and bad.text == tok.decode([10, 11])
    for rid in ("a", "b"):
        assert got[rid].outputs[0] == want[rid].outputs[0]


def test_finish_from_outside_reports_the_tokens_so_far(model_config, tok):
    run = Run(model_config, tok, {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23]})
    run.add("a", [1, 5], SamplingParams(max_tokens=4))
    run.add("b", [1, 5], SamplingParams(max_tokens=4))
    run.step()
    run.step()
    run.state, (out,) = run.outputs.finish(run.state, ["a"], FinishReason.ABORT)
    c = out.outputs[0]
    assert (c.finish_reason, c.token_ids, c.text) == ("abort", [10, 11], tok.decode([10, 11]))
    assert not sched.has_request(run.state, "a")
    check_state(run.state)
    assert run.run()["b"].outputs[0].token_ids == [20, 21, 22, 23]
