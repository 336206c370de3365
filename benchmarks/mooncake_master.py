"""A mooncake_master for the benchmarks that run one (kv_offload.py, soak.py), on loopback inside
their private network namespace: start it, connect a store once it answers, stop it."""

from __future__ import annotations

import signal
import subprocess
import time


def start_master(port: int) -> subprocess.Popen:
    """mooncake_master on 127.0.0.1:port (metrics on port + 1), its output discarded."""
    return subprocess.Popen(
        ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={port}"]
        + [f"--metrics_port={port + 1}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def connect_store(
    port: int,
    block_bytes: int,
    *,
    namespace: str,
    segment_bytes: int,
    buffer_bytes: int,
    timeout_s: float,
):
    """A MooncakeStore on the master at 127.0.0.1:port, retried while a master just started is
    still coming up; its last StoreError after `timeout_s`."""
    from runtime.offload.mooncake_store import MooncakeStore
    from runtime.offload.store import StoreError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return MooncakeStore(
                f"127.0.0.1:{port}",
                block_bytes,
                namespace=namespace,
                segment_bytes=segment_bytes,
                buffer_bytes=buffer_bytes,
            )
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_master(process: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not exited 10 s later."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
