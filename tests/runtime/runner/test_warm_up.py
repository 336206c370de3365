"""Compiling a run's batch shapes up front (runtime/runner/warm_up.py): the padding batch against
the builder's own, and runs that compile nothing after the warm-up, and nothing they do not meet."""

import jax
import pytest

from runtime.core.request import SamplingParams
from runtime.runner.inputs import BatchBuilder, RequestRow
from runtime.runner.warm_up import padding_batch

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# A program found in JAX's persistent cache (on for the whole test run: tests/conftest.py) is
# loaded, not compiled: a step that needed one the warm-up missed shows as this event instead.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _builder(**kw) -> BatchBuilder:
    args = dict(block_size=16, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
    return BatchBuilder(**{**args, **kw})


def test_padding_batch_has_the_builders_arrays():
    """Same names, dtypes and shapes as BatchBuilder.build makes for a real step of the shape,
    so the program compiled from it is the one the step runs."""
    for slots in (0, 3):
        b = _builder(max_num_seqs=8, max_num_batched_tokens=64, num_state_slots=slots)
        rows = {
            r: RequestRow(r, list(range(n)), list(range(1, 3)), n, SamplingParams())
            for r, n in (("a", 20), ("b", 7))
        }
        built = b.build(
            rows,
            {"a": 20, "b": 7},
            ["a", "b"],
            state_slots={"a": 0, "b": 1} if slots else {},
            reset_state_slots=(0, 1) if slots else (),
        )
        shape = (28, 8, 16, 0, 0)  # 27 tokens: quarter steps past max_num_seqs (8)
        assert (built.arrays["token_ids"].shape[0], *built.arrays["block_tables"].shape) == shape[
            :3
        ]
        assert built.decode_chunks == shape[3] and built.tile_chunks == shape[4]
        pad = padding_batch(b, shape)
        assert pad.keys() == built.arrays.keys()
        for name, array in built.arrays.items():
            assert (pad[name].dtype, pad[name].shape) == (array.dtype, array.shape), name
        assert pad["num_seqs"] == 0 and (pad["slot_mapping"] == -1).all()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vlax.default_model import default_model_path
    from vlax.llm import LLM

    path = default_model_path(tmp_path_factory.mktemp("cache"))
    # A 32-token budget chunks the longer prompts; 9 blocks of 16 hold about two of the five
    # requests, so some are preempted; prefix caching is on, so a second call hits.
    return LLM(
        str(path),
        compilation_cache=False,
        max_num_seqs=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        num_kv_blocks=9,
        record_steps=None,
    )


def test_generate_compiles_the_shapes_its_steps_meet_and_no_other(llm, monkeypatch):
    """The steps of a run, chunked prefill and preemption included, compile nothing: the dry run
    of the core planned every shape they meet, and only those were compiled up front (the
    earlier guess compiled 45 shapes for the offline benchmark's run, which met 24, 6 of them
    not among the 45). A second call, which hits the prefix cache, compiles nothing in its
    steps either."""
    compiled_in_steps, met = [], []
    listening = [False]

    def on_duration(event, seconds, **kwargs):
        if event == _BACKEND_COMPILE and listening[0]:
            compiled_in_steps.append(event)

    def on_event(event, **kwargs):
        if event == _CACHE_HIT and listening[0]:
            compiled_in_steps.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    engine = llm.engine
    step, shape = engine.step, engine.runner.builder.shape

    def listened_step():
        listening[0] = True
        try:
            return step()
        finally:
            listening[0] = False

    def recorded_shape(q_lens, kv_lens):
        out = shape(q_lens, kv_lens)
        if listening[0]:
            met.append(out)
        return out

    monkeypatch.setattr(engine, "step", listened_step)
    monkeypatch.setattr(engine.runner.builder, "shape", recorded_shape)
    stem = "the same opening words for every prompt, so that blocks are shared, and then "
    prompts = [stem + tail for tail in ("a", "b c d", "e f g h i j k l m n o p q", "r", "s t")]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 3, 70, 9, 1)
    ]
    first = llm.generate(prompts, params, use_tqdm=False)
    assert compiled_in_steps == []
    assert [len(o.outputs[0].token_ids) for o in first] == [40, 3, 70, 9, 1]
    assert engine.totals.preemptions > 0
    assert any(n > 32 for n in map(len, (o.prompt_token_ids for o in first)))
    compiled = set(llm._compiled)
    assert {s for s, _ in compiled} == set(met)
    met.clear()
    again = llm.generate(prompts, params, use_tqdm=False)
    assert compiled_in_steps == []
    assert {s for s, _ in llm._compiled - compiled} <= set(met)
    hits = [nd.num_computed_tokens for so in engine.history for nd in so.scheduled_new_reqs]
    assert max(hits) > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
