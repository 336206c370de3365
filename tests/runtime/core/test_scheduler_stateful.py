"""Random add / schedule / update / abort interleavings against a small KV pool and encoder cache.

After every transition the ARCHITECTURE.md invariants hold; every request that is not aborted
finishes with exactly the tokens a model run alone would give it, whatever the interleaving
(chunking, preemption, prefix hits) did to it. The same holds for whole workloads under the priority
policy (random priorities, arrivals over time, aborts) on a pool that preempts often.

Hybrid configurations (num_state_slots > 0, some with fewer slots than max_num_seqs so the slot
check binds) run a synthetic recurrent model instead: each request's tokens go through the state
in its slot and the next token depends on that state alone, so a request that started from a state
it did not build (a slot not reset, or inherited from a preempted or finished owner) or lost a chunk
finishes with other tokens than it gets run alone.

Async configurations (vLLM's AsyncScheduler) schedule the next step while one is in flight, with
aborts, preemptions and stops landing between a step's schedule and its update; their runner keeps
its own tokens as a device does (runtime/core/devtools/device_rows.py), so a placeholder the core
miscounts shows as a position the device cannot compute or as other tokens than run alone.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.core import scheduler as sch
from runtime.core.devtools.device_rows import DeviceRows
from runtime.core.devtools.synthetic_runner import (
    ZERO_STATE,
    absorb,
    make_slot_states,
    recurrent_runner_output,
    runner_output,
)
from runtime.core.request import FinishReason, MultiModalInput, Request, SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_output, check_state

BLOCK_SIZE = 4
MAX_MODEL_LEN = 40
EOS = 5
IDS = tuple(f"r{i}" for i in range(6))
# Prompts share prefixes: each is a cut of one of two base sequences.
BASES = (tuple(range(20, 60)), tuple(range(100, 140)))
CONFIGS = [
    {"policy": "fcfs"},
    {"policy": "priority"},
    {"policy": "fcfs", "long_prefill_token_threshold": 6},
    {"policy": "priority", "long_prefill_token_threshold": 6},
    {"policy": "priority", "enable_prefix_caching": False},
    {"policy": "fcfs", "enable_chunked_prefill": False, "max_num_batched_tokens": 40},
    {"policy": "priority", "enable_chunked_prefill": False, "max_num_batched_tokens": 40},
    # hybrid models (prefix caching is off with state slots); max_num_seqs is 3
    {"policy": "fcfs", "enable_prefix_caching": False, "num_state_slots": 3},
    {"policy": "fcfs", "enable_prefix_caching": False, "num_state_slots": 2},
    {
        "policy": "priority",
        "enable_prefix_caching": False,
        "num_state_slots": 2,
        "long_prefill_token_threshold": 6,
    },
    {"policy": "priority", "enable_prefix_caching": False, "num_state_slots": 1},
    {
        "policy": "fcfs",
        "enable_prefix_caching": False,
        "num_state_slots": 2,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 40,
    },
    # async scheduling: one step in flight when the next is planned
    {"policy": "fcfs", "async_scheduling": True},
    {"policy": "priority", "async_scheduling": True},
    {"policy": "fcfs", "long_prefill_token_threshold": 6, "async_scheduling": True},
    {"policy": "priority", "enable_prefix_caching": False, "async_scheduling": True},
    {
        "policy": "fcfs",
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 40,
        "async_scheduling": True,
    },
    {
        "policy": "fcfs",
        "enable_prefix_caching": False,
        "num_state_slots": 2,
        "async_scheduling": True,
    },
    {
        "policy": "priority",
        "enable_prefix_caching": False,
        "num_state_slots": 2,
        "long_prefill_token_threshold": 6,
        "async_scheduling": True,
    },
]


def model_token(request: Request) -> int:
    """The synthetic model: the next token depends only on the request's own tokens."""
    return (request.num_tokens * 7 + len(request.prompt_token_ids)) % 11 + 3


def hybrid_token(state: tuple[int, int]) -> int:
    """The synthetic hybrid model: the next token depends only on the recurrent state."""
    return state[1] % 11 + 3


def device_token(prompt: tuple[int, ...], tokens) -> int:
    """model_token as the device computes it, from the tokens it holds."""
    return (len(tokens) * 7 + len(prompt)) % 11 + 3


def device_hybrid_token(prompt: tuple[int, ...], state: tuple[int, int]) -> int:
    return hybrid_token(state)


def alone(request: Request, hybrid: bool = False) -> tuple[tuple[int, ...], FinishReason]:
    """What the request generates when run alone (the oracle, written independently)."""
    params, out = request.sampling_params, []
    while True:
        if hybrid:
            token = hybrid_token(absorb(ZERO_STATE, request.prompt_token_ids + tuple(out)))
        else:
            probe = Request("probe", request.prompt_token_ids, output_token_ids=tuple(out))
            token = model_token(probe)
        out.append(token)
        total = len(request.prompt_token_ids) + len(out)
        if len(out) >= params.min_tokens and (
            (token in request.eos_token_ids and not params.ignore_eos)
            or token in params.stop_token_ids
        ):
            return tuple(out), FinishReason.STOP
        if total >= MAX_MODEL_LEN or (params.max_tokens and len(out) >= params.max_tokens):
            return tuple(out), FinishReason.LENGTH


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(overrides=st.sampled_from(CONFIGS))
    def start(self, overrides):
        config = {
            "max_num_seqs": 3,
            "max_num_batched_tokens": 16,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": BLOCK_SIZE,
            "num_blocks": 14,
            "encoder_cache_size": 12,
            "encoder_compute_budget": 8,
            **overrides,
        }
        self.state = sch.make_scheduler(sch.SchedulerConfig(**config))
        self.hybrid = bool(self.state.config.num_state_slots)
        # The device's state pool, as the synthetic recurrent runner leaves it.
        self.slot_states = make_slot_states(self.state.config.num_state_slots)
        # Scheduled steps not yet applied, oldest first: (output, runner output or None); async
        # configurations run each step on the device rows when it is scheduled.
        self.pending: list = []
        self.async_mode = self.state.config.async_scheduling
        self.device = DeviceRows(
            device_hybrid_token if self.hybrid else device_token, self.state.config.num_state_slots
        )
        self.arrivals = 0
        self.live: dict[str, Request] = {}  # lifecycles not yet finished
        self.tokens: dict[str, tuple[int, ...]] = {}
        self.aborted: set[str] = set()

    @rule(
        data=st.data(),
        base=st.sampled_from(BASES),
        length=st.integers(1, 30),
        max_tokens=st.integers(1, 24),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop_ids=st.sampled_from([(), (9,)]),
        priority=st.integers(0, 2),
        image=st.sampled_from([None, ("A", 4), ("B", 6), ("C", 8)]),
    )
    def add(
        self, data, base, length, max_tokens, min_tokens, ignore_eos, stop_ids, priority, image
    ):
        free_ids = [rid for rid in IDS if not sch.has_request(self.state, rid)]
        if not free_ids:
            return
        request_id = data.draw(st.sampled_from(free_ids))
        mm = ()
        if image is not None and length >= image[1] + 1:
            offset = data.draw(st.integers(0, length - image[1]))
            mm = (MultiModalInput(image[0], offset, image[1]),)
        request = Request(
            request_id,
            base[:length],
            SamplingParams(
                max_tokens=max_tokens,
                min_tokens=min(min_tokens, max_tokens),
                ignore_eos=ignore_eos,
                stop_token_ids=stop_ids,
            ),
            eos_token_ids=(EOS,),
            arrival_time=float(self.arrivals),
            priority=priority,
            mm_inputs=mm,
        )
        self.arrivals += 1
        self.state = sch.add_request(self.state, request)
        self.live[request_id] = request
        self.tokens[request_id] = ()

    @precondition(lambda self: len(self.pending) < (2 if self.async_mode else 1))
    @rule()
    def schedule(self):
        before = self.state
        self.state, out = sch.schedule(before)
        check_output(before, self.state, out)
        self.pending.append((out, self.device.execute(out) if self.async_mode else None))

    @precondition(lambda self: self.pending)
    @rule()
    def update(self):
        out, runner = self.pending.pop(0)
        if runner is not None:  # async: run on the device rows when scheduled
            pass
        elif self.hybrid:
            self.slot_states, runner = recurrent_runner_output(
                self.slot_states, self.state, out, hybrid_token
            )
        else:
            runner = runner_output(self.state, out, model_token)
        self.state, outputs = sch.update(self.state, out, runner)
        self._collect(outputs)

    @precondition(lambda self: len(self.pending) < (2 if self.async_mode else 1))
    @rule(steps=st.integers(2, 16))
    def run_steps(self, steps):
        """Several whole steps at once, so requests reach their decodes and the pool runs out
        (preemptions, and under priority a request preempting itself) within a short run.
        Async: schedule step N+1, then apply step N, as vLLM's engine core does."""
        for _ in range(steps):
            check_state(self.state)
            self.schedule()
            if len(self.pending) > (1 if self.async_mode else 0):
                self.update()

    @rule(data=st.data())
    def abort(self, data):
        if not self.live:
            return
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.state = sch.abort_requests(self.state, [request_id])
        del self.live[request_id]

    def _collect(self, outputs):
        for o in outputs:
            self.tokens[o.req_id] += o.new_token_ids
            if o.finished:
                request = self.live.pop(o.req_id)
                expected = alone(request, self.hybrid)
                assert (self.tokens[o.req_id], o.finish_reason) == expected, o.req_id

    @invariant()
    def holds(self):
        if hasattr(self, "state"):
            check_state(self.state)

    def teardown(self):
        if not hasattr(self, "state"):
            return
        while self.pending:
            self.update()
        for _ in range(400):
            if not sch.has_unfinished_requests(self.state):
                break
            self.schedule()
            if len(self.pending) > (1 if self.async_mode else 0):
                self.update()
            check_state(self.state)
        while self.pending:
            self.update()
        assert not self.live, f"never finished: {sorted(self.live)}"
        assert self.state.kv.pool.num_free == self.state.kv.pool.num_blocks - 1
        assert all(not e.refs for e in self.state.encoder.entries.values())
        if self.hybrid:
            slots = self.state.state_slots
            assert slots.free == tuple(range(slots.num_slots)) and not slots.owners


SchedulerMachine.TestCase.settings = settings(
    max_examples=170,
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_stateful = SchedulerMachine.TestCase


# ---------------------------------------------------------------- whole priority workloads

PRIORITY_CONFIGS = [
    {},
    {"long_prefill_token_threshold": 6},
    {"enable_prefix_caching": False},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 40},
    # hybrid models: max_num_seqs is 4
    {"enable_prefix_caching": False, "num_state_slots": 4},
    {"enable_prefix_caching": False, "num_state_slots": 2, "long_prefill_token_threshold": 6},
]
ARRIVALS = st.tuples(
    st.integers(0, 40),  # arrival step
    st.sampled_from(BASES),
    st.integers(1, 30),  # prompt length
    st.integers(1, 24),  # max_tokens
    st.integers(0, 3),  # priority
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    overrides=st.sampled_from(PRIORITY_CONFIGS),
    arrivals=st.lists(ARRIVALS, min_size=2, max_size=10),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=3),
)
def test_priority_workloads_run_to_completion(overrides, arrivals, aborts):
    """Requests with random priorities arriving over time on a pool that preempts often (so the
    least urgent running request often needs a block itself), with aborts at random steps: the
    invariants hold after every transition and every request not aborted gets its own tokens."""
    config = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "num_blocks": 11,
        "policy": "priority",
        **overrides,
    }
    state = sch.make_scheduler(sch.SchedulerConfig(**config))
    hybrid = bool(state.config.num_state_slots)
    slot_states = make_slot_states(state.config.num_state_slots)
    arrivals = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    live, tokens = {}, {}
    for step in range(600):
        while arrivals and arrivals[0][1][0] <= step:
            index, (_, base, length, max_tokens, priority) = arrivals.pop(0)
            request = Request(
                f"r{index}",
                base[:length],
                SamplingParams(max_tokens=max_tokens),
                eos_token_ids=(EOS,),
                arrival_time=float(index),
                priority=priority,
            )
            state = sch.add_request(state, request)
            live[request.request_id], tokens[request.request_id] = request, ()
        for request_id in dict.fromkeys(f"r{k}" for at, k in aborts if at == step):
            if request_id in live:
                state = sch.abort_requests(state, [request_id])
                del live[request_id]
        check_state(state)
        if not arrivals and not sch.has_unfinished_requests(state):
            break
        scheduled, out = sch.schedule(state)
        check_state(scheduled)
        check_output(state, scheduled, out)
        if hybrid:
            slot_states, runner = recurrent_runner_output(slot_states, scheduled, out, hybrid_token)
        else:
            runner = runner_output(scheduled, out, model_token)
        state, outputs = sch.update(scheduled, out, runner)
        for o in outputs:
            tokens[o.req_id] += o.new_token_ids
            if o.finished:
                request = live.pop(o.req_id)
                assert (tokens[o.req_id], o.finish_reason) == alone(request, hybrid), o.req_id
    assert not live and not arrivals, f"never finished: {sorted(live)}"
    check_state(state)
    assert state.kv.pool.num_free == state.kv.pool.num_blocks - 1
