"""A mooncake_master for the benchmarks that run one (kv_offload.py, soak.py), on loopback inside
their private network namespace: start it, connect a store once it answers, stop it. The Mooncake
test scenarios (tests/runtime/offload/mooncake_scenario.py) connect and stop through these too;
they start their masters their own way (waiting until they listen, never evicting)."""

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


def connect_store(port: int, block_bytes: int, *, namespace: str, timeout_s: float, **options):
    """A MooncakeStore on the master at 127.0.0.1:port (`options`: MooncakeStore's keywords,
    such as segment_bytes and buffer_bytes), retried while a master just started is still coming
    up; its last StoreError after `timeout_s`."""
    from runtime.offload.mooncake_store import MooncakeStore
    from runtime.offload.store import StoreError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return MooncakeStore(f"127.0.0.1:{port}", block_bytes, namespace=namespace, **options)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_master(process: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM, and SIGKILL if it has not exited `grace_s` later."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
