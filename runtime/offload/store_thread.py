"""A daemon thread that works through a queue of store calls and reports each one on another queue.

The offload worker (worker.py) and the prefix lookups (lookup.py) both call a store on a thread of
their own, so that a slow store never blocks the engine; this is their shared queue plumbing.
"""

import queue
import threading

__all__ = ["StoreThread"]


class StoreThread:
    """Subclasses set their own state first, then call `super().__init__` (which starts the
    thread), and implement `_run`: take items from `_todo` until the `None` that `close` sends,
    and put one report per item on `_done`."""

    def __init__(self, name: str) -> None:
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def take(self, wait_s: float = 0.0) -> list:
        """Every report so far, in the order they were put; with wait_s > 0, first wait that
        long for at least one."""
        done = []
        try:
            done.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return done

    def close(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError
