"""The scheduler with KV store/load jobs, as properties over random interleavings of add /
schedule+update / abort / job completion / job failure, against a model of device memory.

The model: device KV of token position p is a digest of the request's tokens[: p + 1] (KV
depends on the whole prefix). Jobs touch device memory when they *end* (a store reads its
blocks then, a load writes them then), as real asynchronous copies would; so a block that was
reused while a job still needed it shows up as wrong KV in a later computation or in the store.
"""

import hashlib
from dataclasses import replace

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.core import scheduler as sch
from runtime.core.devtools.synthetic_runner import runner_output
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj
from runtime.core.kv_jobs.jobs import KVJobResult, LoadJob, StoreJob
from runtime.core.kv_jobs.scheduler_hooks import enable_kv_jobs, has_pending_kv_jobs
from runtime.core.request import Request, SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_output, check_state

BS = 2
CONFIG = sch.SchedulerConfig(
    max_num_seqs=3, max_num_batched_tokens=8, max_model_len=20, block_size=BS, num_blocks=11
)


def kv_of(tokens, position) -> bytes:
    return hashlib.sha256(repr(tuple(tokens[: position + 1])).encode()).digest()[:6]


class SchedulerWithJobs(RuleBasedStateMachine):
    config = CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.state = enable_kv_jobs(sch.make_scheduler(self.config))
        self.device: dict[int, list] = {}  # block id -> KV per slot
        self.store: dict[bytes, list] = {}  # block hash -> KV per slot
        self.started: dict[int, object] = {}  # job id -> job, started by the "shell"
        self.results: list[KVJobResult] = []  # ended, reported by the next update
        self.planned: set[int] = set()
        self.ended: set[int] = set()
        self.count = 0

    @rule(
        prompt=st.lists(st.integers(0, 1), min_size=1, max_size=10),
        max_tokens=st.integers(1, 4),
        priority=st.integers(0, 2),
        prompt_logprobs=st.sampled_from([None, None, None, 1]),
    )
    def add(self, prompt, max_tokens, priority, prompt_logprobs):
        self.count += 1
        request_id = f"r{self.count % 4}"  # ids are reused once their request finished
        if sch.has_request(self.state, request_id):
            return
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
        request = Request(
            request_id, tuple(prompt), params, arrival_time=self.count, priority=priority
        )
        self.state = sch.add_request(self.state, request)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=BS, max_size=10), data=st.data())
    def stored_elsewhere(self, tokens, data):
        """Another engine stored these blocks (or a waiting request's prompt) in a shared store
        (a Mooncake pool): requests with this prefix load them, often while the local cache
        holds part of it."""
        if self.state.waiting and data.draw(st.booleans()):
            waiting = data.draw(st.sampled_from(self.state.waiting))
            tokens = self.state.requests[waiting].all_token_ids
        probe = Request("probe", tuple(tokens))
        hashes = sch.add_request(sch.make_scheduler(self.config), probe).requests["probe"]
        for index, block_hash in enumerate(hashes.block_hashes):
            self.store[block_hash] = [kv_of(tokens, index * BS + k) for k in range(BS)]
        jobs = kj.note_stored(self.state.kv_jobs, hashes.block_hashes)
        self.state = replace(self.state, kv_jobs=jobs)

    @rule()
    def step(self):
        before = self.state
        after, out = sch.schedule(before)
        check_state(after)
        check_output(before, after, out)
        for job in out.kv_jobs:
            assert job.job_id not in self.planned
            self.planned.add(job.job_id)
            self.started[job.job_id] = job
        self._execute(after, out)
        results, self.results = tuple(self.results), []
        self.state, _ = sch.update(after, out, runner_output(after, out), kv_job_results=results)

    def _execute(self, state, out):
        """Check the KV a request attends to, then write the KV of its scheduled tokens."""
        for request_id, num in out.num_scheduled_tokens.items():
            request = state.requests[request_id]
            tokens = request.all_token_ids
            table = kvc.blocks_of(state.kv, request_id)
            for position in range(request.num_computed_tokens):
                slots = self.device.get(table[position // BS])
                got = None if slots is None else slots[position % BS]
                assert got == kv_of(tokens, position), (
                    f"{request_id} attends to wrong KV at position {position}"
                )
            for position in range(request.num_computed_tokens, request.num_computed_tokens + num):
                slots = self.device.setdefault(table[position // BS], [None] * BS)
                slots[position % BS] = kv_of(tokens, position)

    @precondition(lambda self: self.state.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.state.requests)))
        self.state = sch.abort_requests(self.state, [request_id])

    @precondition(lambda self: self.started)
    @rule(data=st.data(), ok=st.booleans())
    def end_job(self, data, ok):
        self._end(data.draw(st.sampled_from(sorted(self.started))), ok)

    def _end(self, job_id, ok):
        """The shell ends a job: a store reads its blocks now, a load writes them now."""
        job = self.started.pop(job_id)
        if isinstance(job, StoreJob) and ok:
            for block, block_hash in zip(job.block_ids, job.block_hashes, strict=True):
                self.store[block_hash] = list(self.device[block])
        elif isinstance(job, LoadJob) and ok:
            ok = all(h in self.store for h in job.block_hashes)
            if ok:
                for block, block_hash in zip(job.block_ids, job.block_hashes, strict=True):
                    self.device[block] = list(self.store[block_hash])
        self.ended.add(job_id)
        self.results.append(KVJobResult(job_id, ok))

    @invariant()
    def every_job_ends_once_and_pins_hold(self):
        jobs = self.state.kv_jobs
        reported = {r.job_id for r in self.results}
        assert self.planned == set(jobs.in_flight) | (self.ended - reported)
        assert set(self.started) | reported == set(jobs.in_flight)
        assert has_pending_kv_jobs(self.state) == bool(jobs.in_flight)
        if self.state.awaiting_update is None:
            check_state(self.state)

    @invariant()
    def stored_kv_is_the_prefix_it_is_keyed_by(self):
        # Each stored block's KV must belong to the token prefix its hash names: re-derive it
        # from any request that holds the hash.
        for request in self.state.requests.values():
            tokens = request.all_token_ids
            for index, block_hash in enumerate(request.block_hashes):
                if block_hash in self.store:
                    expected = [kv_of(tokens, index * BS + k) for k in range(BS)]
                    assert self.store[block_hash] == expected, f"store polluted at {index}"

    def teardown(self):
        """Liveness: with every job ending as the shell ends it, all requests finish and every
        job ends; requests holding blocks for their loads never wedge the others."""
        for _ in range(200):
            for job_id in sorted(self.started):
                self._end(job_id, True)
            if not sch.has_unfinished_requests(self.state) and not has_pending_kv_jobs(self.state):
                break
            self.step()  # reports the ended jobs
        assert not sch.has_unfinished_requests(self.state), self.state
        assert not has_pending_kv_jobs(self.state)


SchedulerWithJobs.TestCase.settings = settings(max_examples=120, stateful_step_count=50)
TestSchedulerWithJobs = SchedulerWithJobs.TestCase


class PrioritySchedulerWithJobs(SchedulerWithJobs):
    """The same, under the priority policy: the queue of requests holding blocks for a load is
    kept in priority order too."""

    config = replace(CONFIG, policy="priority")


PrioritySchedulerWithJobs.TestCase.settings = settings(max_examples=80, stateful_step_count=50)
TestPrioritySchedulerWithJobs = PrioritySchedulerWithJobs.TestCase


def test_loads_replace_recompute_and_failures_recompute():
    """Scenario: a prompt stored, evicted locally, then served again: loaded, not recomputed."""
    state = enable_kv_jobs(sch.make_scheduler(CONFIG))
    prompt = tuple(range(9))  # 4 full blocks and one more token
    rounds = []
    for round_ in range(3):
        state = sch.add_request(state, Request("p", prompt, SamplingParams(max_tokens=1)))
        # The shell ends every job within its step; round 2's loads fail.
        state, computed = _drain(state, fail_loads=round_ == 2)
        rounds.append((computed, state.kv_jobs.stats))
        # A filler request of unrelated tokens takes every block: the local cache is gone.
        filler = Request(f"f{round_}", tuple(range(100 * round_ + 50, 100 * round_ + 68)))
        state, _ = _drain(sch.add_request(state, filler))
        assert kvc.find_cached_prefix(state.kv, state_request(prompt)).num_tokens == 0
    (first, s1), (second, s2), (third, s3) = rounds
    assert first == 9 and s1.blocks_stored == 4 and s1.blocks_loaded == 0
    assert second == 1 and s2.blocks_loaded == 4 and s2.hit_tokens == 8
    # The failed load recomputes everything, and forgets the stale store entries.
    assert third == 9 and s3.load_failures == 1 and s3.blocks_loaded == 4


def state_request(prompt):
    return sch.add_request(sch.make_scheduler(CONFIG), Request("x", prompt)).requests["x"]


def _drain(state, fail_loads=False):
    computed = 0
    while sch.has_unfinished_requests(state) or has_pending_kv_jobs(state):
        after, out = sch.schedule(state)
        check_state(after)
        computed += out.total_num_scheduled_tokens
        results = tuple(
            KVJobResult(j.job_id, not (fail_loads and isinstance(j, LoadJob))) for j in out.kv_jobs
        )
        state, _ = sch.update(after, out, runner_output(after, out), kv_job_results=results)
    return state, computed


# ---------------------------------------------------------------- regression scenarios

TIGHT = sch.SchedulerConfig(
    max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=9
)


def _stored(state, *requests):
    """`state` whose store holds every full block of the requests' prompts."""
    hashes = [
        h for r in requests for h in sch.add_request(state, r).requests[r.request_id].block_hashes
    ]
    return replace(state, kv_jobs=kj.note_stored(state.kv_jobs, hashes))


def _step(state, results=()):
    after, out = sch.schedule(state)
    check_state(after)
    check_output(state, after, out)
    state, _ = sch.update(after, out, runner_output(after, out), kv_job_results=tuple(results))
    check_state(state)
    return state, out


def test_a_loaded_request_keeps_its_blocks_until_it_is_admitted():
    """A's load (3 blocks) ends; in the next step B, queued behind A, wants 6 blocks from the
    store. It used to be planned first, before A was re-admitted, and took A's freed loaded
    blocks: A's loaded prefill was lost. As vLLM: A holds its blocks and is admitted first with
    12 computed tokens; B's load does not fit beside it (its 7 blocks > 4 free) and waits."""
    a = Request("a", tuple(range(3, 16)), SamplingParams(max_tokens=2))  # 13 tokens: 3 blocks
    b = Request("b", tuple(range(50, 75)), SamplingParams(max_tokens=2))  # 25 tokens: 6 blocks
    state = _stored(enable_kv_jobs(sch.make_scheduler(TIGHT)), a, b)
    state = sch.add_request(state, a)
    after, out = sch.schedule(state)
    (load,) = out.kv_jobs
    assert isinstance(load, LoadJob) and load.req_id == "a" and len(load.block_ids) == 3
    # The shell reports the load done with this step's update.
    state, _ = sch.update(after, out, runner_output(after, out), (KVJobResult(load.job_id, True),))
    check_state(state)
    state = sch.add_request(state, b)

    state, out = _step(state)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "a" and new.num_computed_tokens == 12
    assert new.block_ids[:3] == load.block_ids
    assert out.num_scheduled_tokens == {"a": 1}
    assert not out.kv_jobs  # B's load waits for blocks


def test_requests_loading_kv_do_not_take_running_slots():
    """vLLM 0.33 starts a load in its waiting loop while fewer than max_num_seqs requests run, and
    the loading request does not join `running` (scheduler.py: `num_running =
    len(self.running) + self.num_waiting_for_streaming_input`; the load path skips the request
    into kv_holding_waiting). With max_num_seqs=2 and one running: L1 and L2 both start their
    loads and W is admitted, in the same step. vlax used to count loads against the slots: only
    L1 loaded, and L2 was admitted computing its stored prefix again."""
    config = replace(TIGHT, max_num_seqs=2, num_blocks=33)
    l1 = Request("l1", tuple(range(3, 16)), SamplingParams(max_tokens=2))
    l2 = Request("l2", tuple(range(30, 43)), SamplingParams(max_tokens=2))
    state = _stored(enable_kv_jobs(sch.make_scheduler(config)), l1, l2)
    state = sch.add_request(state, Request("r", tuple(range(60, 69)), SamplingParams(max_tokens=3)))
    state, _ = _step(state)
    for request in (l1, l2, Request("w", tuple(range(80, 89)), SamplingParams(max_tokens=8))):
        state = sch.add_request(state, request)

    state, out = _step(state)
    assert [(type(j), j.req_id) for j in out.kv_jobs if isinstance(j, LoadJob)] == [
        (LoadJob, "l1"),
        (LoadJob, "l2"),
    ]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["w"]
    assert state.running == ("r", "w")
    loads = [j for j in out.kv_jobs if isinstance(j, LoadJob)]

    # The loads end; both running slots are taken, so the loaded requests hold their blocks
    # until "r" finishes, then are admitted one at a time with their 12 loaded tokens.
    state, out = _step(state, [KVJobResult(j.job_id, True) for j in loads])
    admitted = {}
    for _ in range(20):
        state, out = _step(state)
        for new in out.scheduled_new_reqs:
            admitted[new.req_id] = new.num_computed_tokens
        if not sch.has_unfinished_requests(state):
            break
    assert admitted == {"l1": 12, "l2": 12}
