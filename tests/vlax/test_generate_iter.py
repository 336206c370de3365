"""`LLM.generate_iter`: each prompt's output as soon as it and the prompts before it are done."""

import pytest

from vlax import LLM, SamplingParams
from vlax.default_model import default_model_path

SHORT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = default_model_path(tmp_path_factory.mktemp("cache"))
    return LLM(str(path), max_model_len=128, max_num_seqs=4)


def test_outputs_come_in_input_order_before_the_batch_is_done(llm):
    prompts, params = ["a", "b", "c"], [SHORT, LONG, SHORT]
    outputs = llm.generate_iter(prompts, params, use_tqdm=False)
    first = next(outputs)
    assert first.prompt == "a" and len(first.outputs[0].token_ids) == 2
    # "b" is still running when "a" comes out.
    assert llm.engine.has_unfinished_requests()
    # "c" finished with "a" but waits for "b", so the order is the input order.
    rest = list(outputs)
    assert [o.prompt for o in rest] == ["b", "c"]
    whole = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == [
        o.outputs[0].token_ids for o in whole
    ]


def test_stopping_early_aborts_the_prompts_not_yet_returned(llm):
    outputs = llm.generate_iter(["a", "b"], [SHORT, LONG], use_tqdm=False)
    assert next(outputs).prompt == "a"
    outputs.close()
    assert not llm.engine.has_unfinished_requests()
    # The next call returns its own outputs only, and "b" did not run on into it.
    again = llm.generate(["c"], SHORT, use_tqdm=False)
    assert [o.prompt for o in again] == ["c"] and len(again[0].outputs[0].token_ids) == 2
