"""runtime/core imports no JAX and nothing else from the project: the core must stay a pure
Python library that a scheduler test, a notebook or another engine can use without a device."""

import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[3] / "runtime" / "core"


def test_core_modules_import_no_jax_and_no_other_package():
    # every module, subpackages included: a move into a new subpackage must not escape the check
    modules = sorted(
        ".".join(("runtime", "core", *path.relative_to(CORE).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in CORE.rglob("*.py")
    )
    assert "runtime.core.scheduler" in modules
    assert "runtime.core.kv.kv_cache" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('jax', 'jaxlib', 'numpy', 'flax', 'model', 'pallas_kernels', 'vlax')\n"
        "      or (m.startswith('runtime.') and not m.startswith('runtime.core')))\n"
        "print(bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=CORE.parents[1],
    )
    assert result.stdout.strip() == "[]", result.stdout
