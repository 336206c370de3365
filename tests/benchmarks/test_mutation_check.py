"""mutation_pass --check: a mutant that cannot run as meant against today's code is reported
stale, with its reason, and runs nothing."""

from benchmarks.mutants import Mutant
from benchmarks.mutation_runner import check_mutant, run_mutant

SOURCE = "def f(x):\n    y = x + 1\n    return y\n\n\ndef g(x):\n    return x\n    return x\n"


def _root(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "code.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_code.py").write_text("def test_nothing():\n    pass\n")
    return tmp_path


def _mutant(original="y = x + 1", mutated="y = x - 1", file="pkg/code.py", tests=None):
    return Mutant("m", file, original, mutated, tests or ("tests/test_code.py::test_nothing",))


def test_a_mutant_that_applies_has_no_problem(tmp_path):
    assert check_mutant(_root(tmp_path), _mutant()) == []


def test_each_reason_a_mutant_is_stale_is_named(tmp_path):
    root = _root(tmp_path)
    cases = {
        "original line found 0 times in pkg/code.py": _mutant(original="y = x + 2"),
        "original line found 2 times in pkg/code.py": _mutant("return x", "return -x"),
        "pkg/gone.py does not exist": _mutant(file="pkg/gone.py"),
        "test path tests/test_gone.py does not exist": _mutant(tests=("tests/test_gone.py",)),
        "mutated line equals the original": _mutant(mutated="y = x + 1"),
        "mutated pkg/code.py does not compile": _mutant(mutated="y = x +"),
    }
    for reason, mutant in cases.items():
        problems = check_mutant(root, mutant)
        assert len(problems) == 1 and problems[0].startswith(reason), (reason, problems)


def test_the_pass_reports_a_stale_mutant_without_touching_the_file(tmp_path):
    root = _root(tmp_path)
    result = run_mutant(root, _mutant(mutated="y = x +"), timeout=60)
    assert result["status"] == "stale" and "does not compile" in result["detail"]
    assert (root / "pkg" / "code.py").read_text() == SOURCE
