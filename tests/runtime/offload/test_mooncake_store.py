"""The Mooncake tier against a real mooncake_master, in a private network namespace."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_mooncake_scenario_in_a_private_network_namespace():
    script = os.path.join(os.path.dirname(__file__), "mooncake_scenario.py")
    done = subprocess.run(
        ["unshare", "-n", sys.executable, script],
        capture_output=True,
        text=True,
        # A hang guard, not a speed limit: a loaded 2-core machine took 181 s for this one.
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in ("semantics ok", "full pool ok", "jobs ok", "MOONCAKE SCENARIO PASSED"):
        assert line in done.stdout, done.stdout
