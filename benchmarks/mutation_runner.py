"""Runs one mutant: checks the checkout may be mutated, writes the mutant, runs its test subset,
restores the file byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.mutants import Mutant


def matching_lines(text: str, original: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines(keepends=True)) if line.strip() == original]


def check_mutant(root: Path, mutant: Mutant) -> list[str]:
    """Why `mutant` cannot run as meant against today's code; empty when it can.

    Stale: its file is gone, or its original line is not in it exactly once (the code moved on).
    A test path it names that does not exist makes pytest fail on usage, not on the mutant. A
    mutated file that does not compile fails collection: counted as a kill with no test run."""
    path = root / mutant.file
    if not path.is_file():
        return [f"{mutant.file} does not exist"]
    text = path.read_text()
    found = matching_lines(text, mutant.original)
    problems = []
    if len(found) != 1:
        problems.append(f"original line found {len(found)} times in {mutant.file}")
    elif mutant.mutated.strip() == mutant.original:
        problems.append("mutated line equals the original")
    else:
        try:
            compile(_mutate(text, found[0], mutant.mutated), mutant.file, "exec")
        except SyntaxError as e:
            problems.append(f"mutated {mutant.file} does not compile: {e.msg} (line {e.lineno})")
    for test in mutant.tests:
        if not (root / test.split("::")[0]).exists():
            problems.append(f"test path {test} does not exist")
    return problems


def _mutate(text: str, line_index: int, mutated: str) -> str:
    lines = text.splitlines(keepends=True)
    line = lines[line_index]
    indent = line[: len(line) - len(line.lstrip())]
    ending = line[len(line.rstrip("\r\n")) :]
    lines[line_index] = indent + mutated + ending
    return "".join(lines)


def _drop_bytecode(path: Path) -> None:
    # A .pyc is trusted when the source's mtime (whole seconds) and size match; a same-size
    # mutant written within the second would otherwise run the unmutated bytecode.
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    """ "passed", "failed", "timeout" or "error" (pytest itself broke), and the seconds taken."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    seconds = time.monotonic() - start
    # 0 passed; 1 a test failed; 2 collection failed (the mutant broke an import).
    outcome = {0: "passed", 1: "failed", 2: "failed"}.get(proc.returncode, "error")
    if outcome == "error":
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
    return outcome, seconds


def run_mutant(root: Path, mutant: Mutant, timeout: float) -> dict:
    path = root / mutant.file
    result = {"name": mutant.name, "file": mutant.file, "tests": list(mutant.tests)}
    problems = check_mutant(root, mutant)
    if problems:
        return {**result, "status": "stale", "detail": "; ".join(problems)}
    original = path.read_bytes()
    text = original.decode()
    found = matching_lines(text, mutant.original)
    try:
        path.write_text(_mutate(text, found[0], mutant.mutated))
        _drop_bytecode(path)
        outcome, seconds = run_tests(root, mutant.tests, timeout)
    finally:
        path.write_bytes(original)
        _drop_bytecode(path)
    status = {"passed": "survived", "failed": "killed", "timeout": "killed", "error": "error"}
    return {**result, "status": status[outcome], "outcome": outcome, "seconds": round(seconds, 1)}


def check_root(root: Path, files: set[str]) -> None:
    """Refuse a primary checkout (others use it), a root whose tests would import the project
    from elsewhere, and uncommitted changes in `files` (a restored file would lose them)."""
    git = ["git", "-C", str(root), "rev-parse", "--path-format=absolute"]
    dirs = subprocess.run(
        [*git, "--git-dir", "--git-common-dir"], capture_output=True, text=True, check=True
    ).stdout.split()
    if len(dirs) != 2 or dirs[0] == dirs[1]:
        raise SystemExit(
            f"{root} is the primary checkout; mutants would disturb everyone using it. Run from a "
            f"worktree: git -C {root} worktree add /tmp/mutants HEAD"
        )
    probe = "import model, runtime, pallas_kernels as p; print(runtime.__file__, p.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    if not all(Path(w).resolve().is_relative_to(root.resolve()) for w in where):
        raise SystemExit(f"tests started in {root} import the project from {where}, not {root}")
    status = ["git", "-C", str(root), "status", "--porcelain", "--", *sorted(files)]
    out = subprocess.run(status, capture_output=True, text=True, check=True).stdout
    dirty = [line[3:] for line in out.splitlines()]
    if dirty:
        raise SystemExit(f"uncommitted changes in {dirty}: the pass restores files it mutates")
