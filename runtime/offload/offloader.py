"""KVOffloader: what the engine calls to execute the KV jobs the scheduler planned.

    offloader.start(kv_cache, scheduler_output.kv_jobs)   # after the step's model execution
    kv_cache, results = offloader.finish(kv_cache)        # before update(); writes loads
    state = update(state, out, runner_out, kv_job_results=results)

Store gathers are dispatched on the engine thread right after the step that filled the blocks
(the KV cache is donated to the next step, the gathered copy is not); the worker thread waits
for them and writes the store. Loaded rows are written into the KV cache on the engine thread.
"""

from collections.abc import Hashable, Sequence

from runtime.core.kv.block_pool import BlockHash
from runtime.core.kv_jobs.jobs import KVJob, KVJobResult, StoreJob
from runtime.offload.device_copy import block_nbytes, gather_blocks, scatter_blocks
from runtime.offload.lookup import LookupDone, PrefixLookups, stored_prefix
from runtime.offload.store import KVStore
from runtime.offload.worker import OffloadWorker

__all__ = ["KVOffloader", "make_store"]


class KVOffloader:
    def __init__(self, store: KVStore, *, owns_store: bool = True) -> None:
        """`owns_store`: close the store with the offloader (False for a store the user made)."""
        self.store = store
        self.owns_store = owns_store
        self._worker = OffloadWorker(store)
        # Only a shared store can hold prefixes this engine did not store (lookup.py).
        self._lookups = PrefixLookups(store) if store.shared else None
        # The latest failure messages, newest last, for logs and notebooks.
        self.errors: list[str] = []

    @property
    def num_in_flight(self) -> int:
        return self._worker.num_in_flight

    def start(self, kv_cache, jobs: Sequence[KVJob]) -> None:
        for job in jobs:
            if isinstance(job, StoreJob):
                rows, n = gather_blocks(kv_cache, job.block_ids)
                self._worker.submit_store(job, rows, n)
            else:
                self._worker.submit_load(job)

    def finish(self, kv_cache, wait_s: float = 0.0) -> tuple[object, tuple[KVJobResult, ...]]:
        """Collect ended jobs (waiting up to wait_s for one); write the rows of ok loads."""
        results = []
        for done in self._worker.take(wait_s):
            result = done.result
            if done.rows is not None:
                kv_cache, finite = scatter_blocks(kv_cache, done.job.block_ids, done.rows)
                if not finite:
                    result = KVJobResult(result.job_id, False)
                    self._note(done.job, "loaded blocks hold NaN or inf; recomputing them")
            if done.error is not None:
                self._note(done.job, done.error)
            results.append(result)
        return kv_cache, tuple(results)

    def stored_prefix(self, block_hashes: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
        """The leading run of block_hashes the store holds, asked on this thread (blocking);
        a store that cannot answer holds nothing we can count on."""
        try:
            return stored_prefix(self.store, block_hashes)
        except Exception as err:
            self._add_error(f"exists: {err!r}; nothing counted as stored")
            return ()

    def submit_lookup(self, token: Hashable, block_hashes: Sequence[BlockHash]) -> None:
        """Ask a shared store, on the lookup thread, how much of the prefix it holds; the answer
        comes back from `take_lookups` under `token`."""
        if self._lookups is None:
            raise ValueError("prefix lookups are for a shared store (KVStore.shared)")
        self._lookups.submit(token, block_hashes)

    def take_lookups(self, wait_s: float = 0.0) -> list[LookupDone]:
        """The lookups answered so far (a failed one found nothing; its error is noted)."""
        if self._lookups is None:
            return []
        done = self._lookups.take(wait_s)
        for answer in done:
            if answer.error is not None:
                self._add_error(f"lookup {answer.token}: {answer.error}; nothing found")
        return done

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        self._worker.close()
        if self.owns_store:
            self.store.close()

    def _note(self, job: KVJob, message: str) -> None:
        self._add_error(f"{type(job).__name__} {job.job_id}: {message}")

    def _add_error(self, message: str) -> None:
        self.errors = [*self.errors[-63:], message]


def make_store(
    kind: str,
    kv_cache,
    *,
    kv_offload_bytes: int,
    mooncake_master: str | None = None,
    namespace: str = "default",
) -> KVStore:
    """The store a configuration names; `namespace` separates models sharing a Mooncake pool."""
    nbytes = block_nbytes(kv_cache)
    if kind == "host":
        from runtime.offload.host_store import HostStore

        return HostStore(kv_offload_bytes, nbytes)
    if kind == "mooncake":
        from runtime.offload.mooncake_store import MooncakeStore

        if not mooncake_master:
            raise ValueError("kv_offload='mooncake' needs mooncake_master='HOST:PORT'")
        return MooncakeStore(
            mooncake_master,
            nbytes,
            namespace=namespace,
            segment_bytes=kv_offload_bytes,
            buffer_bytes=max(16 << 20, 4 * nbytes),
        )
    raise ValueError(f"kv_offload={kind!r}: expected 'host' or 'mooncake'")
