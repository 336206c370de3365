"""Step message value types: validation and ordering."""

import pytest

from runtime.core.outputs import (
    LogprobsEntry,
    ModelRunnerOutput,
    SchedulerOutput,
    frozen_mapping,
)


def test_model_runner_output_validates_shapes():
    ModelRunnerOutput(("a", "b"), ((1,), ()))
    with pytest.raises(ValueError, match="2 req_ids but 1"):
        ModelRunnerOutput(("a", "b"), ((1,),))
    with pytest.raises(ValueError, match="repeated"):
        ModelRunnerOutput(("a", "a"), ((1,), (2,)))
    with pytest.raises(ValueError, match="1 logprobs entries for 2"):
        ModelRunnerOutput(("a", "b"), ((1,), (2,)), logprobs=(None,))


def test_logprobs_entry_rows_and_head():
    entry = LogprobsEntry(((1, 2), (3, 4)), ((-0.1, -2.0), (-0.5, -1.0)), (0, 1))
    assert entry.head(1).token_ids == ((1, 2),) and entry.head(1).sampled_token_ranks == (0,)
    assert entry.head(5) is entry
    with pytest.raises(ValueError, match="one of each per position"):
        LogprobsEntry(((1,),), ((-0.1,),), ())
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        LogprobsEntry(((1, 2),), ((-0.1,),), (0,))


def test_scheduler_output_maps_keep_batch_order_and_are_read_only():
    tokens = frozen_mapping({"z": 1, "a": 5, "m": 2})
    out = SchedulerOutput(
        step=0,
        scheduled_new_reqs=(),
        scheduled_cached_reqs=(),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=8,
        scheduled_encoder_inputs=frozen_mapping({}),
        free_encoder_hashes=(),
        preempted_req_ids=(),
        finished_req_ids=(),
    )
    assert out.req_ids == ("z", "a", "m")
    with pytest.raises(TypeError):
        out.num_scheduled_tokens["z"] = 3  # type: ignore[index]
    assert out == SchedulerOutput(**{f: getattr(out, f) for f in out.__slots__})
