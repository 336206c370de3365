"""Check every Pallas kernel against its jnp reference on a GPU with the real Triton lowering, and time both.

    python -m benchmarks.gpu_kernels            # on a GPU host: full table
    python -m benchmarks.gpu_kernels --cpu-smoke  # anywhere: tiny shapes, interpret mode (tests use this)

On a host without a GPU (and without --cpu-smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import jax

from benchmarks.gpu_common import Case, allclose, max_error, median_ms

CASE_MODULES = (
    "benchmarks.gpu_ragged_paged_attention",
    "benchmarks.gpu_flash_attention",
    "benchmarks.gpu_sparse_mla_decode",
    "benchmarks.gpu_kda",
)


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for name in CASE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        cases.extend(mod.cases())
    return cases


def run_case(case: Case, *, interpret: bool, iters: int) -> dict:
    args = case.make_inputs(jax.random.key(0))
    pallas_fn = jax.jit(case.pallas(interpret))
    ref_fn = jax.jit(case.reference())
    out_p = jax.block_until_ready(pallas_fn(*args))
    out_r = jax.block_until_ready(ref_fn(*args))
    row = {
        "op": case.op,
        "case": case.name,
        "ok": allclose(out_p, out_r, case.atol, case.rtol),
        "max_err": max_error(out_p, out_r),
    }
    row["pallas_ms"] = median_ms(pallas_fn, args, iters=iters)
    row["jnp_ms"] = median_ms(ref_fn, args, iters=iters)
    row["speedup"] = row["jnp_ms"] / row["pallas_ms"] if row["pallas_ms"] > 0 else float("nan")
    return row


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'op':<24} {'case':<44} {'ok':<3} {'max_err':>9} {'pallas ms':>10} {'jnp ms':>9} {'x':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['op']:<24} {r['case']:<44} {'y' if r['ok'] else 'N':<3} {r['max_err']:>9.2e} "
            f"{r['pallas_ms']:>10.3f} {r['jnp_ms']:>9.3f} {r['speedup']:>6.2f}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in interpret mode")
    ap.add_argument("--json", action="store_true", help="print rows as one JSON object")
    ap.add_argument("--only", default=None, help="substring filter on op name")
    args = ap.parse_args(argv)

    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if not on_gpu and not args.cpu_smoke:
        print(f"no GPU found (default backend: {jax.default_backend()}); nothing to run.")
        return 0
    cases = [c for c in all_cases() if (c.smoke or not args.cpu_smoke)]
    if args.only:
        cases = [c for c in cases if args.only in c.op]
    rows = []
    for case in cases:
        rows.append(run_case(case, interpret=not on_gpu, iters=3 if args.cpu_smoke else 50))
        if not args.json:
            print(f"  done {case.op}/{case.name}", file=sys.stderr)
    if args.json:
        print(json.dumps({"device": str(jax.devices()[0]), "rows": rows}))
    else:
        print(f"device: {jax.devices()[0]}")
        print_table(rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
