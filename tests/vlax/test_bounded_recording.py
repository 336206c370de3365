"""Bounded recording: an LLM keeps step history only when asked, so a long batch job holds nothing
per request or per step once its outputs are returned."""

import gc
import tracemalloc

import pytest

from vlax import LLM, SamplingParams
from vlax.default_model import default_model_path

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
ENGINE = dict(max_model_len=32, max_num_seqs=256, block_size=16)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(default_model_path(tmp_path_factory.mktemp("cache")))


def prompts(start, count):
    return [
        {"prompt_token_ids": [1, 3 + i % 800, 3 + i // 800 % 800]}
        for i in range(start, start + count)
    ]


def retained_growth(llm, warm=1000, first=1000, then=4000) -> int:
    """Bytes still held (Python objects) after `first + then` requests minus after `first`."""
    llm.generate(prompts(0, warm), PARAMS, use_tqdm=False)  # every shape compiled
    gc.collect()
    tracemalloc.start()
    try:
        llm.generate(prompts(warm, first), PARAMS, use_tqdm=False)
        gc.collect()
        after_first = tracemalloc.get_traced_memory()[0]
        for start in range(warm + first, warm + first + then, 1000):
            llm.generate(prompts(start, 1000), PARAMS, use_tqdm=False)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - after_first
    finally:
        tracemalloc.stop()


def test_memory_stays_flat_over_5000_requests_when_not_recording(path):
    llm = LLM(path, **ENGINE)
    growth = retained_growth(llm)
    assert not llm.engine.history and not llm.engine.stats
    assert llm.engine.totals.steps > 0
    # 4000 more requests: a leak of even 20 bytes each would show.
    assert growth < 80_000, f"{growth} bytes retained by 4000 more requests"


def test_recording_keeps_what_was_asked_for(path):
    every = LLM(path, record_steps=None, **ENGINE)
    # The same measure sees what recording every step holds (the check above can fail).
    assert retained_growth(every, warm=256, first=256, then=2000) > 80_000
    assert len(every.engine.history) == len(every.engine.stats) == every.engine.totals.steps
    last = LLM(path, record_steps=3, **ENGINE)
    last.generate(prompts(0, 600), PARAMS, use_tqdm=False)
    assert last.engine.totals.steps > 3
    assert [s.step for s in last.engine.stats] == [so.step for so in last.engine.history]
    assert (
        len(last.engine.history) == 3 and last.engine.history[-1].step == last.engine.stats[-1].step
    )
