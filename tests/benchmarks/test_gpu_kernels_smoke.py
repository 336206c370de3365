"""The shared GPU kernel harness runs end to end on CPU: every contributed smoke case, in interpret
mode, agrees with its reference."""

import json

from benchmarks import gpu_kernels


def test_cpu_smoke_every_row_ok(capsys):
    rc = gpu_kernels.main(["--cpu-smoke", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert rows, "no smoke cases were collected"
    assert {"ragged_paged_attention", "flash_attention"} <= {r["op"] for r in rows}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert rc == 0
    assert all(r["pallas_ms"] > 0 and r["jnp_ms"] > 0 for r in rows)


def test_without_gpu_it_says_so_and_exits_zero(capsys):
    assert gpu_kernels.main([]) == 0
    assert "no GPU found" in capsys.readouterr().out
