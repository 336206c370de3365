"""Mutation pass: plausible one-line bugs, each run against the tests that exist for its code.

A mutant is killed when its test subset fails (or times out) and survives when the subset passes.
Every survivor is either a gap in the tests or an equivalent mutant (one that cannot change what
the code computes). The mutants are in `benchmarks/mutants/` (one module per area), the running
of one in `benchmarks/mutation_runner.py`; this is the command and its report.

The pass edits source files while it runs, so it refuses to run in the primary checkout: run it
in a separate git worktree, from the repository it lives in:

    git worktree add /tmp/mutants HEAD
    cd /tmp/mutants && python -m benchmarks.mutation_pass [--only NAME ...] [--json]

The worktree's own code is what the tests import (pytest is started from its root, first on
sys.path); the pass checks that before it starts. Each file is restored byte for byte after its
mutant. `--check` runs nothing: it lists the stale mutants (original line not found exactly once
in today's code, a test path that is gone, a mutated file that does not compile) with the reason,
and exits 1 if there is one; the pass itself reports those as stale without running them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.mutants import MUTANTS
from benchmarks.mutation_runner import check_mutant, check_root, run_mutant, run_tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant")
    parser.add_argument("--check", action="store_true", help="list stale mutants, run none")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="first run every test subset unmutated and stop if one fails (a red subset would "
        "count every mutant as killed)",
    )
    args = parser.parse_args(argv)
    names = {m.name for m in MUTANTS}
    if len(names) != len(MUTANTS):
        raise SystemExit("two mutants share a name")
    unknown = set(args.only or ()) - names
    if unknown:
        raise SystemExit(f"unknown mutants {sorted(unknown)}; known: {sorted(names)}")
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    root = args.root
    if args.check:
        stale = {m.name: problems for m in chosen if (problems := check_mutant(root, m))}
        print(json.dumps({"mutants": len(chosen), "stale": stale}, indent=2))
        return 1 if stale else 0
    check_root(root, {m.file for m in chosen})
    if args.baseline:
        for tests in dict.fromkeys(m.tests for m in chosen):
            outcome, seconds = run_tests(root, tests, args.timeout)
            sys.stderr.write(f"baseline  {outcome:6s} {seconds:7.1f}s  {' '.join(tests)}\n")
            if outcome != "passed":
                raise SystemExit(f"baseline {outcome}: {' '.join(tests)}")
    results = []
    for mutant in chosen:
        result = run_mutant(root, mutant, args.timeout)
        results.append(result)
        sys.stderr.write(
            f"{result['status']:9s} {result.get('seconds', 0):7.1f}s  {mutant.name}"
            f"  ({mutant.file})\n"
        )
        sys.stderr.flush()
    killed = [r for r in results if r["status"] == "killed"]
    survived = [r for r in results if r["status"] == "survived"]
    decided = len(killed) + len(survived)
    summary = {
        "mutants": len(results),
        "killed": len(killed),
        "survived": len(survived),
        "stale": [r["name"] for r in results if r["status"] == "stale"],
        "errors": [r["name"] for r in results if r["status"] == "error"],
        "kill_rate": round(len(killed) / decided, 3) if decided else None,
        "survivors": [r["name"] for r in survived],
        "results": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"killed {len(killed)} of {decided} ({summary['kill_rate']}); "
            f"survivors: {summary['survivors']}; stale: {summary['stale']}; "
            f"errors: {summary['errors']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
