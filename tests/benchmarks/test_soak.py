"""The soak with faults (benchmarks/soak.py) at CI size: 80 requests on the embedded default model
under the priority policy, a KV pool of two or three requests' worth, random aborts, and a host
store failing 15% of its reads and writes. Every check of the benchmark must hold: one final
output per request, greedy and seeded tokens equal to a fault-free run, nothing left held, no
/dev/shm segment left (a process SIGKILLed mid-create included). Resident memory is bounded at the
full size only (SoakSize.rss_growth_limit says why)."""

from benchmarks.soak import run_soak
from benchmarks.soak_workload import SIZES


def test_soak_with_a_faulty_host_store_loses_nothing():
    report = run_soak("host", SIZES["ci"], seed=0, progress=False)
    assert report["failed_checks"] == [], report
    # The run did meet what it is about (counts that hold under any thread timing).
    assert report["aborts"] > 0 and report["preemptions"] > 0, report
    assert report["store_faults_injected"] > 0 and report["offload"]["blocks_loaded"] > 0, report
    assert report["checked_requests"] > report["requests"] // 5, report
    assert report["shm_reclaimed_after_sigkill"] == 1
