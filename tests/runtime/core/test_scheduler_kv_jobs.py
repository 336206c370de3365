"""The scheduler with KV store/load jobs, as properties over random interleavings of add /
schedule+update / abort / job completion / job failure, against a model of device memory.

The model: device KV of token position p is a digest of the request's tokens[: p + 1] (KV
depends on the whole prefix). Jobs touch device memory when they *end* (a store reads its
blocks then, a load writes them then), as real asynchronous copies would; so a block that was
reused while a job still needed it shows up as wrong KV in a later computation or in the store.
"""

import hashlib

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.core import kv_cache as kvc
from runtime.core import scheduler as sch
from runtime.core.kv_jobs import KVJobResult, LoadJob, StoreJob
from runtime.core.request import Request, SamplingParams
from runtime.core.scheduler_invariants import check_output, check_state
from runtime.core.scheduler_kv_jobs import enable_kv_jobs, has_pending_kv_jobs
from runtime.core.synthetic_runner import runner_output

BS = 2
CONFIG = sch.SchedulerConfig(
    max_num_seqs=3, max_num_batched_tokens=8, max_model_len=20, block_size=BS, num_blocks=11
)


def kv_of(tokens, position) -> bytes:
    return hashlib.sha256(repr(tuple(tokens[: position + 1])).encode()).digest()[:6]


class SchedulerWithJobs(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = enable_kv_jobs(sch.make_scheduler(CONFIG))
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
    )
    def add(self, prompt, max_tokens):
        self.count += 1
        request_id = f"r{self.count % 4}"  # ids are reused once their request finished
        if sch.has_request(self.state, request_id):
            return
        request = Request(request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens))
        self.state = sch.add_request(self.state, request)

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
        job_id = data.draw(st.sampled_from(sorted(self.started)))
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


SchedulerWithJobs.TestCase.settings = settings(max_examples=120, stateful_step_count=50)
TestSchedulerWithJobs = SchedulerWithJobs.TestCase


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
