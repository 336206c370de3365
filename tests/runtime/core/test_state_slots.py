"""The recurrent-state slot pool as a value, and the SchedulerConfig knob that turns it on."""

import pytest
from immutables import Map

from runtime.core.kv_jobs.scheduler_hooks import enable_kv_jobs
from runtime.core.scheduling.scheduler_config import SchedulerConfig, SchedulerConfigError
from runtime.core.scheduling.scheduler_state import SchedulerError, make_scheduler
from runtime.core.state import state_slots as ss

BASE = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, "block_size": 4}


def test_take_gives_the_lowest_free_slot_and_release_returns_it():
    empty = ss.make_state_slots(3)
    one, a = ss.take(empty, "a")
    two, b = ss.take(one, "b")
    assert (a, b) == (0, 1) and two.free == (2,)
    back = ss.release(two, "a")
    assert back.free == (0, 2) and ss.slot_of(back, "a") is None and ss.slot_of(back, "b") == 1
    again, c = ss.take(back, "c")
    assert c == 0  # the freed slot is reused first
    for pool in (empty, one, two, back, again):
        ss.check_invariants(pool)
    # values: the older pools are untouched
    assert empty.free == (0, 1, 2) and not empty.owners and one.free == (1, 2)


def test_misuse_names_the_request_and_leaves_the_pool_as_it_was():
    pool, _ = ss.take(ss.make_state_slots(1), "a")
    with pytest.raises(ss.StateSlotsError, match="'a' already holds state slot 0"):
        ss.take(pool, "a")
    with pytest.raises(ss.StateSlotsError, match="all 1 state slots are held"):
        ss.take(pool, "b")
    with pytest.raises(ss.StateSlotsError, match="'b' holds no state slot"):
        ss.release(pool, "b")
    assert pool.free == () and dict(pool.owners) == {"a": 0}
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ss.StateSlotsError, match="num_slots"):
            ss.make_state_slots(bad)


def test_invariants_catch_a_slot_held_twice_lost_or_both_free_and_held():
    broken = {
        "two owners": ss.StateSlots(2, (1,), Map({"a": 0, "b": 0})),
        "both free and held": ss.StateSlots(2, (0, 1), Map({"a": 0})),
        "not exactly": ss.StateSlots(3, (2,), Map({"a": 0})),
        "strictly increasing": ss.StateSlots(3, (2, 1), Map({"a": 0})),
    }
    for message, pool in broken.items():
        with pytest.raises(AssertionError, match=message):
            ss.check_invariants(pool)


def test_config_num_state_slots():
    assert make_scheduler(SchedulerConfig(**BASE, num_blocks=17)).state_slots is None
    config = SchedulerConfig(**BASE, num_blocks=17, num_state_slots=2, enable_prefix_caching=False)
    assert make_scheduler(config).state_slots.free == (0, 1)
    for bad in (-1, True, 1.5):
        with pytest.raises(SchedulerConfigError, match=r"num_state_slots=.*expected an int >= 0"):
            SchedulerConfig(**BASE, num_blocks=17, num_state_slots=bad)
    # A prefix hit would skip the tokens the recurrent state is built from.
    with pytest.raises(SchedulerConfigError, match="enable_prefix_caching=True with num_state"):
        SchedulerConfig(**BASE, num_blocks=17, num_state_slots=2)
    assert issubclass(SchedulerConfigError, ValueError)
    # Nor can a KV load skip tokens: KV jobs are keyed by prefix-cache hashes.
    with pytest.raises(SchedulerError, match="enable_prefix_caching=True"):
        enable_kv_jobs(make_scheduler(config))
