"""A soak with faults: thousands of requests through one engine while its store fails under it.

    python -m benchmarks.soak [--json] [--size full|ci] [--store host,mooncake] [--seed 0]

The embedded default model (`LLM()` with no model, in float32: `engine_args` says why), the
priority policy with random priorities, a KV pool of a few requests' worth (admission and decode
preempt often), requests arriving while others run, random prompt lengths and max_tokens, and
random aborts of running, waiting, preempted and loading requests. Host offload goes through a
`FaultyStore` around a real `HostStore` that fails a seeded fraction of its reads and writes; the
`mooncake` variant goes through a real Mooncake pool (in a private network namespace, as root)
whose master is killed with SIGKILL a third of the way in and restarted at half way.

After each run it checks, and the JSON reports: every request got exactly one final output
(finished or aborted, with a reason that fits); greedy and seeded requests that were not aborted
have the tokens of a fault-free run (no store, no aborts); nothing is left held (blocks, pins, KV
jobs, request slots), by the core invariant checkers; resident memory after the run against after
a warm-up run of the same engine (at the full size: SoakSize.rss_growth_limit, after a warm-up
of a whole workload, with the programs compiled during the run reported beside it); no /dev/shm
segment left, including by a process SIGKILLed while creating its store (the next store reclaims
it, logging). A check that fails makes the command exit non-zero.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from tqdm.auto import tqdm

from benchmarks.mooncake_master import connect_store, start_master, stop_master
from benchmarks.soak_checks import (
    Outputs,
    check_nothing_held,
    check_outputs,
    rss_bytes,
    shm_segments,
)
from benchmarks.soak_workload import SIZES, SoakRequest, SoakSize, make_workload, reference_tokens
from runtime.core.request import RequestStatus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 47851
FAULT_RATE = 0.15  # of store reads and of store writes
ABORT_RATE = 0.08  # chance per step that one request is aborted
MUST_BE_ZERO = (
    "outputs_lost",
    "outputs_duplicated",
    "outputs_stray",
    "bad_finish_reasons",
    "mismatched_tokens",
    "leaked_blocks",
    "leaked_pins",
    "leaked_jobs",
    "leaked_slots",
    "shm_segments_left",
)


class CompileCounter:
    """Programs XLA compiled in this process (JAX's monitoring event), to tell the resident
    memory a run's first-met batch shapes load from a leak."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    count = 0
    _listening = False

    @classmethod
    def listen(cls) -> None:
        import jax

        if not cls._listening:
            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            cls._listening = True

    @classmethod
    def _on_duration(cls, event: str, duration: float, **kwargs) -> None:
        if event == cls.EVENT:
            cls.count += 1


def engine_args(size: SoakSize) -> dict:
    # float32, not the bfloat16 dtype="auto" gives the embedded model: the tokens are checked
    # against a fault-free run, whose steps batch the requests otherwise. XLA:CPU's dots of other
    # row counts sum in another order (~1e-6 relative, either dtype); a bf16 model rounds each
    # result to bf16, which now and then turns that into a whole bf16 ulp and parts near-tied
    # logits: one token of 40 requests, in one of four CI-size runs on an AVX512-BF16 host. In
    # f32 the difference stays ~1e-6.
    return dict(
        dtype="float32",
        max_model_len=size.max_model_len,
        block_size=size.block_size,
        num_kv_blocks=size.num_kv_blocks + 1,
        max_num_seqs=size.max_num_seqs,
        max_num_batched_tokens=size.max_num_batched_tokens,
        scheduling_policy="priority",
    )


@dataclass
class Master:
    """The mooncake_master the mooncake variant kills and restarts mid-run."""

    process: subprocess.Popen | None = None
    kills: int = 0
    restarts: int = 0

    def start(self) -> None:
        self.process = start_master(PORT)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.kills += 1

    def restart(self) -> None:
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        if self.process is not None:
            stop_master(self.process)


def drive(
    engine,
    workload: list[SoakRequest],
    seed: int,
    *,
    abort_rate: float,
    progress: bool,
    on_added=None,
) -> tuple[Outputs, Counter]:
    """Feed `workload` in order while the engine runs, aborting at random; step until idle.

    Requests arrive in bursts while fewer than two batches' worth are unfinished. A request that
    reuses an id waits until the earlier holder of that id has ended. Returns the final outputs
    (from `step` and from `abort_request`) and the aborts by what the request was doing."""
    rng = np.random.default_rng(seed)
    outputs, aborts = Outputs(), Counter()
    live: dict[str, int] = {}  # request id -> workload index of its live holder
    next_index = 0
    target = 2 * engine.config.max_num_seqs

    def final(output) -> None:
        outputs.add(live.pop(output.request_id, None), output)
        bar.update(1)

    with tqdm(total=len(workload), desc="soak", unit="req", disable=not progress) as bar:
        while next_index < len(workload) or engine.has_unfinished_requests():
            burst = int(rng.integers(0, 4)) if len(live) < target else 0
            if not live:
                burst = max(burst, 1)
            while burst and next_index < len(workload):
                req = workload[next_index]
                if req.request_id in live:
                    break
                engine.add_request(
                    req.request_id, list(req.prompt_token_ids), req.params, priority=req.priority
                )
                live[req.request_id] = req.index
                next_index += 1
                burst -= 1
                if on_added is not None:
                    on_added(next_index)
            if live and rng.random() < abort_rate:
                kind, request_id = pick_abort(engine.state, rng)
                if request_id is not None:
                    for output in engine.abort_request([request_id]):
                        final(output)
                    aborts[kind] += 1
            for output in engine.step():
                final(output)
    return outputs, aborts


def pick_abort(state, rng) -> tuple[str, str | None]:
    """A random unfinished request from a random non-empty group: running, waiting (never
    run), preempted (back in the queue) or loading (waiting for its KV from the store)."""
    groups = {"running": list(state.running), "waiting": [], "preempted": [], "loading": []}
    for request_id in state.waiting:
        status = state.requests[request_id].status
        groups["preempted" if status is RequestStatus.PREEMPTED else "waiting"].append(request_id)
    for request_id, request in state.requests.items():
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            groups["loading"].append(request_id)
    kinds = [kind for kind, ids in groups.items() if ids]
    if not kinds:
        return "none", None
    kind = kinds[int(rng.integers(len(kinds)))]
    ids = sorted(groups[kind])
    return kind, ids[int(rng.integers(len(ids)))]


def make_store(kind: str, nbytes: int, size: SoakSize, seed: int, fault_rate: float):
    from runtime.offload.fault_injection import FaultyStore

    if kind == "host":
        from runtime.offload.host_store import HostStore

        inner = HostStore(size.store_blocks * nbytes, nbytes)
    else:
        inner = connect_store(
            PORT,
            nbytes,
            namespace="soak",
            segment_bytes=max(16 << 20, size.store_blocks * nbytes),
            buffer_bytes=max(16 << 20, 4 * nbytes),
            timeout_s=30,
        )
    return FaultyStore(inner, read_fault_rate=fault_rate, write_fault_rate=fault_rate, seed=seed)


def run_soak(
    kind: str,
    size: SoakSize,
    seed: int = 0,
    *,
    fault_rate: float = FAULT_RATE,
    abort_rate: float = ABORT_RATE,
    progress: bool = True,
    master: Master | None = None,
) -> dict:
    """One soak: reference run, warm-up, the run, then every check. Returns the report."""
    from runtime.offload.device_copy import block_nbytes
    from vlax import LLM

    start, cpu_start = time.perf_counter(), time.process_time()
    shm_before = shm_segments()
    reference_engine = LLM(**engine_args(size)).engine
    vocab = reference_engine.model_config.vocab_size
    workload = make_workload(size, vocab, seed)
    reference = reference_tokens(reference_engine, workload)
    nbytes = block_nbytes(reference_engine.runner.kv_caches)
    del reference_engine
    reference_cpu = time.process_time() - cpu_start

    store = make_store(kind, nbytes, size, seed, fault_rate)
    engine = LLM(**engine_args(size), kv_offload=store).engine
    warmup = make_workload(replace(size, num_requests=size.warmup_requests), vocab, seed + 1)
    drive(engine, warmup, seed + 1, abort_rate=abort_rate, progress=False)
    gc.collect()
    warm_cpu = time.process_time() - cpu_start - reference_cpu
    rss_warm = rss_bytes()
    totals_before = replace(engine.totals)
    faults_before = store.num_injected
    offload_before = engine.offload_stats

    on_added = None
    if master is not None:

        def on_added(added: int) -> None:
            if added == len(workload) // 3:
                master.kill()
            elif added == len(workload) // 2:
                master.restart()

    CompileCounter.listen()
    compiles_before = CompileCounter.count
    run_start, run_cpu = time.perf_counter(), time.process_time()
    outputs, aborts = drive(
        engine, workload, seed, abort_rate=abort_rate, progress=progress, on_added=on_added
    )
    run_wall, run_cpu = time.perf_counter() - run_start, time.process_time() - run_cpu
    compiles_during_run = CompileCounter.count - compiles_before
    gc.collect()
    rss_after = rss_bytes()
    report = {
        "store": kind,
        "requests": len(workload),
        "aborts": sum(aborts.values()),
        "aborts_by_state": dict(aborts),
        "store_faults_injected": store.num_injected - faults_before,
        "store_faults_by_kind": {f"{op} {k}": n for (op, k), n in sorted(store.injected.items())},
        "preemptions": engine.totals.preemptions - totals_before.preemptions,
        "steps": engine.totals.steps - totals_before.steps,
    }
    report.update(check_outputs(workload, outputs, reference, size.max_model_len))
    report.update(check_nothing_held(engine))
    stats, before = engine.offload_stats, offload_before
    report["offload"] = {
        name: getattr(stats, name) - getattr(before, name)
        for name in ("blocks_stored", "blocks_loaded", "store_failures", "load_failures")
    }
    engine.close()
    store.close()
    del engine
    report["shm_segments_left"] = len(shm_segments() - shm_before)
    report["shm_reclaimed_after_sigkill"] = sigkill_in_creation_and_reclaim()
    report["shm_segments_left"] += len(shm_segments() - shm_before)
    if master is not None:
        report["master_kills"], report["master_restarts"] = master.kills, master.restarts
    report["rss_warm_mib"] = round(rss_warm / 2**20, 1)
    report["rss_after_mib"] = round(rss_after / 2**20, 1)
    report["rss_growth"] = round(rss_after / rss_warm - 1, 4)
    report["rss_growth_limit"] = size.rss_growth_limit
    report["warmup_requests"] = size.warmup_requests
    report["compiles_during_run"] = compiles_during_run
    report["run_wall_s"] = round(run_wall, 1)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["cpu_s"] = round(time.process_time() - cpu_start, 1)
    report["cpu_s_by_phase"] = {
        "reference": round(reference_cpu, 1),
        "warmup": round(warm_cpu, 1),
        "run": round(run_cpu, 1),
    }
    report["failed_checks"] = failed_checks(report)
    return report


def failed_checks(report: dict) -> list[str]:
    failed = [f"{name}={report[name]}" for name in MUST_BE_ZERO if report.get(name)]
    if report["invariant_errors"]:
        failed.append(f"invariant_errors={report['invariant_errors']}")
    limit = report["rss_growth_limit"]
    if limit is not None and report["rss_growth"] > limit:
        failed.append(f"rss_growth={report['rss_growth']} > {limit}")
    if report["shm_reclaimed_after_sigkill"] != 1:
        failed.append(f"shm_reclaimed_after_sigkill={report['shm_reclaimed_after_sigkill']}")
    return failed


# A process that creates a HostStore in /dev/shm and is SIGKILLed inside the creation window
# (after the O_EXCL create, before the unlink): the free-space probe stands for the reservation.
_KILLED_CHILD = """
import sys
from runtime.offload.host_store import HostStore

def probe(directory):
    print("IN WINDOW", flush=True)
    sys.stdin.read()  # until killed

HostStore(1 << 20, 4096, free_bytes=probe)
"""


def sigkill_in_creation_and_reclaim() -> int:
    """Segments the next HostStore reclaimed (and logged) after a child was SIGKILLed mid-create."""
    from runtime.offload.host_store import HostStore

    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout.readline() == "IN WINDOW\n"
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
    left = shm_segments()
    records = []
    handler = _ListHandler(records)
    logger = logging.getLogger("runtime.offload.shm_segments")
    logger.addHandler(handler)
    try:
        HostStore(4096, 4096).close()
    finally:
        logger.removeHandler(handler)
    reclaimed = [r for r in records if f"left by process {child.pid}" in r.getMessage()]
    return len(reclaimed) if not (shm_segments() & left) else 0


class _ListHandler(logging.Handler):
    def __init__(self, records: list) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _in_netns(args) -> dict:
    """The mooncake variant, inside `unshare -n`: loopback up, a master, the soak."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    master = Master()
    master.start()
    try:
        return run_soak(
            "mooncake", SIZES[args.size], args.seed, progress=args.progress, master=master
        )
    finally:
        master.stop()


def _mooncake(args) -> dict:
    if os.geteuid() != 0:
        return {"store": "mooncake", "failed_checks": ["needs root for unshare -n"]}
    command = ["unshare", "-n", sys.executable, "-m", "benchmarks.soak", "--inside-netns"]
    command += ["--size", args.size, "--seed", str(args.seed)]
    command += ["--progress"] if args.progress else []
    done = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode not in (0, 1) or not lines:
        return {"store": "mooncake", "failed_checks": [f"exit {done.returncode}, no report"]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--store", default="host,mooncake", help="host, mooncake or both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true", help="a tqdm bar even off a terminal")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.progress = args.progress or sys.stderr.isatty()
    logging.getLogger("runtime.offload.shm_segments").setLevel(logging.WARNING)
    if args.inside_netns:
        report = _in_netns(args)
        print(json.dumps(report))
        return 1 if report["failed_checks"] else 0
    reports = []
    for kind in args.store.split(","):
        if kind == "host":
            reports.append(run_soak("host", SIZES[args.size], args.seed, progress=args.progress))
        elif kind == "mooncake":
            reports.append(_mooncake(args))
        else:
            parser.error(f"--store {kind!r}: expected host or mooncake")
    if args.json:
        print(json.dumps({report["store"]: report for report in reports}, indent=1))
    else:
        for report in reports:
            print(f"{report['store']}: " + ", ".join(f"{k}={v}" for k, v in report.items()))
    return 1 if any(r["failed_checks"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
