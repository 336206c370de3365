"""Compiling a run's batch shapes up front (runtime/runner/warm_up.py): the shapes chosen, the
padding batch against the builder's own, and a run that compiles nothing after the warm-up."""

import jax
import pytest

from pallas_kernels.ragged_paged_attention import tiles
from runtime.core.request import SamplingParams
from runtime.runner.inputs import BatchBuilder, RequestRow
from runtime.runner.warm_up import padding_batch, run_shapes

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _builder(**kw) -> BatchBuilder:
    args = dict(block_size=16, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
    return BatchBuilder(**{**args, **kw})


def test_run_shapes_first_step_then_decode_for_every_count_and_context():
    b = _builder()
    # One short prompt: the first step and its decode share the smallest buckets.
    assert run_shapes(b, [5], [32], max_num_seqs=64, max_num_batched_tokens=2048) == [
        (16, 8, 16, 0, 0)
    ]
    # 20 prompts of 100 tokens: one 2000-token first step over 20 sequences; decode with 20
    # down to 1 running (seq buckets 32, 16, 8), contexts 101..350 tokens (block buckets 16, 24).
    shapes = run_shapes(b, [100] * 20, [250] * 20, max_num_seqs=64, max_num_batched_tokens=2048)
    assert shapes[0] == (2048, 32, 16, 0, 0)
    assert shapes[1:] == [
        (32, 32, 16, 0, 0), (32, 32, 24, 0, 0), (16, 16, 16, 0, 0), (16, 16, 24, 0, 0), (16, 8, 16, 0, 0),
        (16, 8, 24, 0, 0),
    ]  # fmt: skip
    # The budget cuts the first step: 3 prompts of 1000 take 2048 tokens over 3 sequences.
    first = run_shapes(b, [1000] * 3, [8] * 3, max_num_seqs=64, max_num_batched_tokens=2048)[0]
    assert first == (2048, 8, 64, 0, 0)
    # max_num_seqs caps the first step's sequences and the decode counts.
    shapes = run_shapes(b, [10] * 40, [4] * 40, max_num_seqs=16, max_num_batched_tokens=2048)
    assert shapes == [(256, 16, 16, 0, 0), (16, 16, 16, 0, 0), (16, 8, 16, 0, 0)]
    assert run_shapes(b, [], [], max_num_seqs=16, max_num_batched_tokens=2048) == []


def test_run_shapes_decode_contexts_end_before_the_last_token():
    """The last output token is sampled, never fed back: a one-token request (`vlax generate
    --max-tokens 1`) has no decode step, and the longest decode context is prompt + max_tokens - 1
    (it used to be counted one further, compiling a bucket no step meets)."""
    b = _builder()
    assert run_shapes(b, [5], [1], max_num_seqs=64, max_num_batched_tokens=2048) == [
        (16, 8, 16, 0, 0)
    ]
    assert run_shapes(b, [300, 5], [1, 1], max_num_seqs=64, max_num_batched_tokens=2048) == [
        (512, 8, 24, 0, 0)
    ]
    # 250 + 7 - 1 = 256 tokens: 16 blocks, the first block bucket (257 would be bucket 24).
    assert run_shapes(b, [250], [7], max_num_seqs=64, max_num_batched_tokens=2048) == [
        (256, 8, 16, 0, 0),
        (16, 8, 16, 0, 0),
    ]
    # Only the requests that decode count: one of two asks for a single token.
    shapes = run_shapes(b, [300, 5], [1, 4], max_num_seqs=64, max_num_batched_tokens=2048)
    assert shapes == [(512, 8, 24, 0, 0), (16, 8, 16, 0, 0)]


def test_run_shapes_with_decode_chunks_cover_every_live_chunk_bucket():
    """With the jnp decode path, a decode step's shape is its live-chunk bucket at the full
    table width; the warm-up covers every bucket between the fewest chunks the fewest requests
    of a sequence bucket hold (shortest context) and the most the most requests hold."""
    b = _builder(decode_chunk_blocks=8)  # 128-key chunks; 2048 tokens: 16 chunks per sequence
    steps = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
    assert b.decode_chunk_buckets(8) == steps
    shapes = run_shapes(b, [100] * 20, [250] * 20, max_num_seqs=64, max_num_batched_tokens=2048)
    assert shapes[0] == (2048, 32, 16, 0, 0)  # the prefill keeps its table-width bucket
    # 17..20 requests of 101..350 tokens: 17 x 1 to 20 x 3 chunks; 9..16: 9 to 48; 1..8: 1 to 24.
    assert shapes[1:] == [
        (32, 32, 128, 32, 0), (32, 32, 128, 40, 0), (32, 32, 128, 48, 0), (32, 32, 128, 56, 0),
        (32, 32, 128, 64, 0),
        (16, 16, 128, 16, 0), (16, 16, 128, 20, 0), (16, 16, 128, 24, 0), (16, 16, 128, 28, 0),
        (16, 16, 128, 32, 0), (16, 16, 128, 40, 0), (16, 16, 128, 48, 0),
        (16, 8, 128, 8, 0), (16, 8, 128, 10, 0), (16, 8, 128, 12, 0), (16, 8, 128, 14, 0),
        (16, 8, 128, 16, 0), (16, 8, 128, 20, 0), (16, 8, 128, 24, 0),
    ]  # fmt: skip
    # Every decode step a run of them meets is one of these shapes.
    rows = {
        f"r{i}": RequestRow(f"r{i}", [0] * (n + 1), list(range(1, 2 + n // 16)), 100, None, n)
        for i, n in enumerate([100, 349, 200, 100, 349])
    }
    built = b.build(rows, {r: 1 for r in rows}, list(rows))
    assert built.arrays["block_tables"].shape == (8, 128)
    assert built.decode_chunks == 10  # 1 + 3 + 2 + 1 + 3 = 10 chunks
    assert (16, 8, 128, 10, 0) in shapes


def test_run_shapes_with_tiles_give_the_first_steps_pair_bucket():
    """With the jnp path's tiles, a step of multi-token rows is its live (query tile, KV chunk)
    pair bucket at the full table width: the warm-up's first step is the one build() makes."""
    b = _builder(decode_chunk_blocks=8, tiled_steps=True)
    prompts = [100] * 20
    shapes = run_shapes(b, prompts, [250] * 20, max_num_seqs=64, max_num_batched_tokens=2048)
    rows = {
        f"r{i}": RequestRow(f"r{i}", [0] * n, list(range(1, 2 + n // 16)), n, None)
        for i, n in enumerate(prompts)
    }
    built = b.build(rows, {r: 100 for r in rows}, list(rows))
    pairs = tiles.tile_chunks([(100, 100)] * 20, 16)
    assert built.tile_chunks >= pairs and built.decode_chunks == 0
    assert built.tile_chunks in b.tile_chunk_buckets(2048, 32)
    assert built.arrays["block_tables"].shape == (32, 128)
    assert shapes[0] == (2048, 32, 128, 0, built.tile_chunks)
    # Decode steps keep their live-chunk buckets, and count no pairs.
    assert all(s[3] > 0 and s[4] == 0 for s in shapes[1:])
    # Without decode chunks (another kernel) there are no tiles either.
    assert not _builder(tiled_steps=True).tiled_steps


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
        shape = (32, 8, 16, 0, 0)
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
    # Prefix caching off: a second call's prefix-cache hits make first steps of other shapes
    # (some of their prompt tokens computed, not all, and not one per sequence), which the
    # warm-up does not claim to cover (warm_up.py's docstring). Off, the second call repeats
    # the first's steps exactly.
    return LLM(
        str(path),
        compilation_cache=False,
        max_num_seqs=8,
        max_model_len=128,
        enable_prefix_caching=False,
    )


def test_generate_compiles_its_shapes_before_the_first_step(llm, monkeypatch):
    """The steps of a plain run compile nothing: its shapes were compiled up front. The same
    call again compiles nothing at all (the shapes are remembered)."""
    compiled_in_steps = []
    listening = [False]

    def on_duration(event, seconds, **kwargs):
        if event == _BACKEND_COMPILE and listening[0]:
            compiled_in_steps.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    engine = llm.engine
    step = engine.step

    def listened_step():
        listening[0] = True
        try:
            return step()
        finally:
            listening[0] = False

    monkeypatch.setattr(engine, "step", listened_step)
    prompts = ["hello there", "a longer prompt than the first one, by a few words"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert compiled_in_steps == []
    assert all(len(o.outputs[0].token_ids) == 20 for o in first)
    compiled = set(llm._compiled)
    assert compiled
    listening[0] = True  # the whole second call: warm-up and steps
    again = llm.generate(prompts, params, use_tqdm=False)
    listening[0] = False
    assert compiled_in_steps == [] and llm._compiled == compiled
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
