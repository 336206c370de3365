"""The thread that executes KV jobs against a store, and reports each job's end exactly once.

Store jobs arrive as already-dispatched device gathers (so the engine may donate its KV cache to
the next step at once); the worker waits for the copy to host and puts the rows. Load jobs are
store reads; the rows go back to the engine thread, which owns the KV cache and writes them.
"""

import threading
from dataclasses import dataclass

import jax
import numpy as np

from runtime.core.kv_jobs.jobs import KVJob, KVJobResult, LoadJob, StoreJob
from runtime.offload.device_copy import rows_to_host
from runtime.offload.store import KVStore
from runtime.offload.store_thread import StoreThread

__all__ = ["JobDone", "OffloadWorker"]


@dataclass(frozen=True, slots=True)
class JobDone:
    job: KVJob
    result: KVJobResult
    # For a successful load: the rows to write, [len(job.block_ids), block_nbytes] uint8.
    rows: np.ndarray | None = None
    error: str | None = None


class OffloadWorker(StoreThread):
    """`take` gives back a JobDone for every job that ended."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self._live: set[int] = set()
        self._lock = threading.Lock()
        super().__init__("vlax-kv-offload")

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def submit_store(self, job: StoreJob, rows: jax.Array, n: int) -> None:
        self._submit(job, (rows, n))

    def submit_load(self, job: LoadJob) -> None:
        self._submit(job, None)

    def _submit(self, job: KVJob, payload) -> None:
        with self._lock:
            if job.job_id in self._live:
                raise ValueError(f"KV job {job.job_id} was submitted twice")
            # Registered before it is queued, so it counts as in flight until its one report.
            self._live.add(job.job_id)
        self._todo.put((job, payload))

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            job, payload = item
            done = JobDone(job, KVJobResult(job.job_id, False), error="worker ended early")
            try:
                done = self._execute(job, payload)
            except Exception as err:  # a job failure, reported; never the worker's end
                done = JobDone(job, KVJobResult(job.job_id, False), error=repr(err))
            finally:
                with self._lock:
                    self._live.discard(job.job_id)
                self._done.put(done)

    def _execute(self, job: KVJob, payload) -> JobDone:
        if isinstance(job, StoreJob):
            rows, n = payload
            host = rows_to_host(rows, n)
            put = self.store.put(job.block_hashes, list(host))
            missing = sum(1 for ok in put.stored if not ok)
            result = KVJobResult(job.job_id, missing == 0, put.evicted)
            error = f"{missing} of {n} blocks were not stored" if missing else None
            return JobDone(job, result, error=error)
        values = self.store.get(job.block_hashes)
        if len(values) != len(job.block_hashes):
            error = f"the store answered {len(values)} values for {len(job.block_hashes)} keys"
            return JobDone(job, KVJobResult(job.job_id, False), error=error)
        missing = sum(1 for v in values if v is None)
        if missing:
            error = f"{missing} of {len(values)} blocks are not in the store"
            return JobDone(job, KVJobResult(job.job_id, False), error=error)
        rows = [np.frombuffer(v, dtype=np.uint8) for v in values]
        sizes = {row.size for row in rows} - {self.store.block_nbytes}
        if sizes:
            error = f"the store gave values of {sorted(sizes)} bytes, not {self.store.block_nbytes}"
            return JobDone(job, KVJobResult(job.job_id, False), error=error)
        rows = np.stack(rows)
        return JobDone(job, KVJobResult(job.job_id, True), rows=rows)
