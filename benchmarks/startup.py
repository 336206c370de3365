"""Start-up: wall time from process start to the first generated token of `vlax generate`.

    python -m benchmarks.startup [--json] [--repeats 3]

`vlax generate --prompt Hello --max-tokens 1` on the embedded default checkpoint: the clock
starts just before the process is spawned and stops when its first output line (the prompt's
one generated token) arrives on stdout. "cold": an empty JAX compilation cache, so every batch
shape compiles; "warm": the same command again on the cache the cold run filled, as a user's
second run. Each repeat has its own fresh VLAX_CACHE_DIR (the checkpoint, written once here
beforehand, is copied in, so its first-use write is not timed). "import_jax" is a bare
`python -c "import jax"`, the floor any JAX program pays. Figures are medians of --repeats runs;
on a shared machine other processes' load adds to every one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_COMMAND = ["-m", "vlax.cli", "generate", "--prompt", "Hello", "--max-tokens", "1", "--no-progress"]


def _env(cache: Path) -> dict:
    env = {**os.environ, "VLAX_CACHE_DIR": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # vlax's own directory, under the fresh cache
    return env


def time_to_first_line(args: list[str], env: dict) -> float:
    """Seconds from spawning `python args` to its first stdout line (or its exit, if it prints
    none: `import jax`)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    seconds = time.perf_counter() - start
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{args} exited {proc.returncode}: {err[-2000:]}")
    if args[:1] != ["-c"] and not line.startswith("[prompt 0]"):
        raise RuntimeError(f"{args}: expected the first completion first, got {line!r}")
    return seconds


def measure(repeats: int) -> dict:
    from vlax.default_model import default_model_path

    runs: dict[str, list[float]] = {"import_jax": [], "cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="vlax-startup-") as tmp:
        model = default_model_path(Path(tmp) / "model")
        for i in range(repeats):
            cache = Path(tmp) / f"run{i}"
            shutil.copytree(model, cache / model.name)
            env = _env(cache)
            runs["import_jax"].append(time_to_first_line(["-c", "import jax"], env))
            runs["cold"].append(time_to_first_line(_COMMAND, env))
            runs["warm"].append(time_to_first_line(_COMMAND, env))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "command": "vlax generate --prompt Hello --max-tokens 1 --no-progress",
        "repeats": repeats,
        "median_s": {k: round(v, 3) for k, v in medians.items()},
        "warm_over_import_jax": round(medians["warm"] / medians["import_jax"], 2),
        "cold_over_warm": round(medians["cold"] / medians["warm"], 2),
        "runs_s": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    result = measure(args.repeats)
    if not args.json:
        m = result["median_s"]
        print(
            f"first token: cold {m['cold']:.2f} s, warm {m['warm']:.2f} s; import jax "
            f"{m['import_jax']:.2f} s (warm / import jax = {result['warm_over_import_jax']}x)"
        )
        return
    print(json.dumps(result))


if __name__ == "__main__":
    main()
