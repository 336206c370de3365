"""Recorded runs replay to identical outputs, and kept states never change afterwards."""

import pytest
from scheduler_driver import request

from runtime.core.devtools.replay import record, replay
from runtime.core.devtools.state_diff import state_diff
from runtime.core.devtools.synthetic_runner import runner_output
from runtime.core.kv import block_pool as bp
from runtime.core.request import MultiModalInput
from runtime.core.scheduling.scheduler_config import SchedulerConfig
from runtime.core.scheduling.scheduler_invariants import check_state

CONFIG = SchedulerConfig(
    max_num_seqs=3, max_num_batched_tokens=24, max_model_len=64, block_size=4, num_blocks=17
)
SHARED = tuple(range(40, 56))


def _arrivals():
    return {
        0: [request("a", 24, 20), request("b", SHARED + (1, 2), 12)],
        2: [request("c", SHARED + (3,), 6, mm=(MultiModalInput("img", 2, 6),))],
        5: [request("d", 30, 8, priority=1)],
        9: [request("e", SHARED, 4)],
    }


def _fingerprint(state):
    return (
        state.step,
        state.waiting,
        state.running,
        tuple(
            sorted(
                (rid, r.status, r.num_computed_tokens, r.output_token_ids, r.block_hashes)
                for rid, r in state.requests.items()
            )
        ),
        tuple(sorted(state.kv.tables.items())),
        bp.free_order(state.kv.pool),
        tuple(bp.block_hash_of(state.kv.pool, b) for b in range(1, state.kv.pool.num_blocks)),
        tuple(sorted((h, e.refs) for h, e in state.encoder.entries.items())),
    )


def test_replay_gives_identical_outputs_and_old_states_stay_unchanged():
    prints = []

    def runner(state, out):
        prints.append(_fingerprint(state))
        return runner_output(state, out)

    run = record(CONFIG, _arrivals(), runner, aborts={7: ["d"]})
    assert any(o.preempted_req_ids for o in run.outputs), "the workload should preempt"
    assert any(n.num_computed_tokens for o in run.outputs for n in o.scheduled_new_reqs)
    again = replay(run.trace)
    assert again.outputs == run.outputs
    assert again.engine_outputs == run.engine_outputs
    assert [_fingerprint(s) for s in run.scheduled] == prints
    # Revisiting states in any order reads the same values; each is still a valid state.
    for state in (run.scheduled[3], run.before[10], run.scheduled[0], run.final):
        check_state(state)
    assert [_fingerprint(s) for s in reversed(run.scheduled)] == prints[::-1]
    assert [_fingerprint(s) for s in again.scheduled] == prints


def test_state_diff_names_what_a_step_changed():
    run = record(CONFIG, _arrivals(), runner_output)
    diff = state_diff(run.before[0], run.scheduled[0])
    assert diff["running"] == ((), ("a",))
    assert diff["awaiting_update"] == (None, 0)
    assert diff["requests"]["a"]["status"] == ("WAITING", "RUNNING")
    assert "block_tables" in diff and diff["free_blocks"][1] < diff["free_blocks"][0]
    assert state_diff(run.final, run.final) == {}


def test_record_rejects_bad_event_steps():
    with pytest.raises(ValueError, match="arrivals keyed by step -1"):
        record(CONFIG, {-1: [request("a", 4)]}, runner_output)
