"""KV job lifecycle as properties: random interleavings of request and job events, with the
KV-cache invariants (ref count = tables + job pins, free xor held) checked after every step."""

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj

BLOCK_SIZE = 2
NUM_BLOCKS = 9
MAX_LEN = 16
REQ_IDS = ("a", "b", "c")


class JobLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = kvc.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE, max_model_len=MAX_LEN)
        self.jobs = kj.make_kv_jobs()
        # request id -> (token ids, num computed tokens); tokens are from a tiny alphabet so
        # requests share prefixes and hit each other's cached and stored blocks.
        self.requests: dict[str, tuple[tuple[int, ...], int]] = {}
        self.ended: set[int] = set()
        self.planned: set[int] = set()

    def _hashes(self, tokens):
        return kvc.extend_block_hashes((), tokens, BLOCK_SIZE)

    @rule(
        req_id=st.sampled_from(REQ_IDS), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12)
    )
    def admit(self, req_id, tokens):
        """Admission as the scheduler does it: local prefix hit, then a load of stored blocks."""
        if req_id in self.requests:
            return
        tokens = tuple(tokens)
        hashes = self._hashes(tokens)
        hit = kvc.find_cached_prefix(self.kv, _Req(hashes, len(tokens)))
        max_blocks = (len(tokens) - 1) // BLOCK_SIZE
        n_remote = kj.stored_run(self.jobs, hashes, len(hit.blocks), max_blocks)
        computed = hit.num_tokens
        remote_tokens = n_remote * BLOCK_SIZE
        new = remote_tokens if n_remote else len(tokens) - computed
        result = kvc.allocate_slots(
            self.kv,
            req_id,
            new,
            0,
            hit.blocks,
            block_hashes=() if n_remote else hashes,
        )
        if isinstance(result, kvc.CannotAllocate):
            return
        self.kv = result.state
        if n_remote:
            table = kvc.blocks_of(self.kv, req_id)
            first = len(hit.blocks)
            self.jobs, self.kv, job = kj.plan_load(
                self.jobs,
                self.kv,
                req_id,
                table[first : first + n_remote],
                hashes[first : first + n_remote],
                computed,
            )
            self.planned.add(job.job_id)
            self.requests[req_id] = (tokens, computed)
        else:
            self.requests[req_id] = (tokens, len(tokens))

    @rule(tokens=st.lists(st.integers(0, 1), min_size=2, max_size=12))
    def found_in_store(self, tokens):
        """The shell found blocks in the store (another engine stored them, or a stale belief)."""
        self.jobs = kj.note_stored(self.jobs, self._hashes(tuple(tokens)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def store(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, _ = self.requests[req_id]
        num_cached = self.kv.num_cached[req_id]
        table = kvc.blocks_of(self.kv, req_id)
        hashes = self._hashes(tokens)
        self.jobs, self.kv, job = kj.plan_store(
            self.jobs, self.kv, req_id, table[:num_cached], hashes[:num_cached]
        )
        if job is not None:
            self.planned.add(job.job_id)
            assert job.block_hashes and not set(job.block_hashes) & set(self.jobs.stored)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_preempt_or_abort(self, data):
        # All three drop the request's references at once; its jobs keep their pins.
        req_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.jobs = kj.detach_request(self.jobs, req_id)
        self.kv = kvc.free(self.kv, req_id)
        del self.requests[req_id]

    @precondition(lambda self: self.jobs.in_flight)
    @rule(data=st.data(), ok=st.booleans())
    def end(self, data, ok):
        job_id = data.draw(st.sampled_from(sorted(self.jobs.in_flight)))
        job = self.jobs.in_flight[job_id]
        owns = self.jobs.loading.get(job.req_id) == job_id
        before = {b: bp.ref_count(self.kv.pool, b) for b in job.block_ids}
        self.jobs, self.kv, ended = kj.end_job(self.jobs, self.kv, kj.KVJobResult(job_id, ok))
        assert ended == job
        for block, count in Counter(job.block_ids).items():
            assert bp.ref_count(self.kv.pool, block) == before[block] - count
        self.ended.add(job_id)
        if isinstance(job, kj.LoadJob) and owns and job.req_id in self.requests:
            tokens, _ = self.requests[job.req_id]
            if ok:
                # The loaded blocks become the request's cached prefix once it computes the rest.
                done = job.first_token + len(job.block_ids) * BLOCK_SIZE
                result = kvc.allocate_slots(
                    self.kv, job.req_id, len(tokens) - done, done, block_hashes=self._hashes(tokens)
                )
                if isinstance(result, kvc.Allocated):
                    self.kv = result.state
                    self.requests[job.req_id] = (tokens, len(tokens))
            else:
                self.requests[job.req_id] = (tokens, job.first_token)

    @precondition(lambda self: self.ended)
    @rule(data=st.data(), ok=st.booleans())
    def end_again_raises(self, data, ok):
        job_id = data.draw(st.sampled_from(sorted(self.ended)))
        with pytest.raises(kj.KVJobError, match=f"KV job {job_id} already ended"):
            kj.end_job(self.jobs, self.kv, kj.KVJobResult(job_id, ok))

    @rule()
    def unknown_job_raises(self):
        with pytest.raises(kj.KVJobError, match="was never planned"):
            kj.end_job(self.jobs, self.kv, kj.KVJobResult(self.jobs.next_job_id, True))

    @invariant()
    def refs_equal_holders(self):
        kvc.check_invariants(self.kv, extra_holders=kj.pins(self.jobs))
        for block in kj.pins(self.jobs):
            assert not bp.is_free(self.kv.pool, block)

    @invariant()
    def every_job_ends_exactly_once(self):
        assert self.planned == self.ended | set(self.jobs.in_flight)
        assert not self.ended & set(self.jobs.in_flight)
        storing = {
            h
            for j in self.jobs.in_flight.values()
            if isinstance(j, kj.StoreJob)
            for h in j.block_hashes
        }
        assert set(self.jobs.storing) == storing
        for req_id, job_id in self.jobs.loading.items():
            assert self.jobs.in_flight[job_id].req_id == req_id


class _Req:
    def __init__(self, block_hashes, num_tokens):
        self.block_hashes, self.num_tokens = block_hashes, num_tokens


JobLifecycle.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
TestJobLifecycle = JobLifecycle.TestCase
