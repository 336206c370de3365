"""The batch's recurrent-state rows: each sequence row's state slot and whether it starts from zero
state, taken from the scheduler's slots and resets; padding rows use the scratch slot; a slot the
core got wrong (shared, missing, reset mid-sequence, not reset at token 0) is refused before the
device step, where it would hand a request another request's state."""

import numpy as np
import pytest

from runtime.runner.inputs import BatchBuilder, RequestRow

NUM_SLOTS = 5


def _builder():
    return BatchBuilder(
        block_size=4,
        max_model_len=64,
        max_num_seqs=NUM_SLOTS,
        max_num_batched_tokens=64,
        num_state_slots=NUM_SLOTS,
    )


def _rows():
    return {
        # decode of a running request: 6 tokens known, 5 computed
        "a": RequestRow("a", list(range(100, 106)), [7, 3], 5, None, num_computed_tokens=5),
        # first chunk of a new request
        "b": RequestRow("b", list(range(200, 212)), [9, 2, 5], 12, None, num_computed_tokens=0),
        # a later chunk of a prefill
        "c": RequestRow("c", list(range(300, 310)), [4, 6, 8], 10, None, num_computed_tokens=4),
    }


SCHEDULED = {"a": 1, "b": 6, "c": 6}


def test_rows_carry_their_slots_and_the_fresh_ones_are_reset():
    hb = _builder().build(
        _rows(),
        SCHEDULED,
        ["a", "b", "c"],
        state_slots={"a": 3, "b": 0, "c": 4},
        reset_state_slots=(0,),
    )
    a = hb.arrays
    s_pad = a["kv_lens"].shape[0]
    assert s_pad == NUM_SLOTS  # the one sequence bucket: two padding rows
    # Padding rows: the scratch slot (num_slots), always starting from zero state so the
    # scratch never carries anything between steps.
    np.testing.assert_array_equal(a["state_slots"], [3, 0, 4] + [NUM_SLOTS] * 2)
    np.testing.assert_array_equal(a["state_reset"], [False, True, False] + [True] * 2)
    assert a["state_slots"].dtype == np.int32 and a["state_reset"].dtype == np.bool_


def test_a_re_admitted_request_in_a_reused_slot_starts_fresh():
    """The regression scenario at the runner: 'x' was preempted and its slot 2 given to 'y' in
    the same step; later 'x' is re-admitted (computing from token 0 again) into slot 1. Both
    fresh rows are reset; neither reads the state its slot held."""
    rows = {
        "y": RequestRow("y", list(range(10, 17)), [1, 2], 7, None, num_computed_tokens=0),
        "x": RequestRow("x", list(range(20, 29)), [3, 4, 5], 9, None, num_computed_tokens=0),
    }
    hb = _builder().build(
        rows, {"y": 7, "x": 9}, ["y", "x"], state_slots={"y": 2, "x": 1}, reset_state_slots=(1, 2)
    )
    np.testing.assert_array_equal(hb.arrays["state_slots"][:2], [2, 1])
    assert hb.arrays["state_reset"][:2].all()


@pytest.mark.parametrize(
    "slots, reset, message",
    [
        ({"a": 3, "b": 0}, (0,), r"request 'c' is scheduled with state slot None; expected one of"),
        ({"a": 3, "b": 0, "c": 5}, (0,), r"state slot 5; expected one of 0\.\.4"),
        ({"a": 3, "b": 0, "c": 3}, (0,), r"state slots \[3\] are given to more than one request"),
        (
            {"a": 3, "b": 0, "c": 4},
            (),
            r"request 'b' computes from token 0 with state slot 0 not reset: it would start from "
            r"the state the slot's previous owner left",
        ),
        (
            {"a": 3, "b": 0, "c": 4},
            (0, 4),
            r"request 'c' computes from token 4 with state slot 4 reset: a state started from "
            r"zero there would miss the tokens before it",
        ),
        (
            {"a": 3, "b": 0, "c": 4},
            (0, 1),
            r"state slots \[1\] are reset but no request scheduled this step holds them",
        ),
    ],
)
def test_wrong_slots_are_refused_naming_the_request(slots, reset, message):
    with pytest.raises(ValueError, match=message):
        _builder().build(
            _rows(), SCHEDULED, ["a", "b", "c"], state_slots=slots, reset_state_slots=reset
        )
