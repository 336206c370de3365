"""The per-host bfloat16 decision (runtime/runner/cpu_bf16.py), for every kind of host, whatever
CPU runs the tests: the decision is a function of the flags given, not of this machine's."""

import logging

from runtime.runner import cpu_bf16
from runtime.runner.cpu_bf16 import choose, cpu_flags
from runtime.runner.model_runner import cache_dtype

_BASE = {"fpu", "sse2", "avx", "fma"}


def test_each_host_kind_gets_its_choice_and_reason():
    cases = [
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx_bf16"),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"),
        ({"avx2"}, "avx2"),
        ({"avx2", "avx512f"}, "avx2"),  # AVX-512 without its bf16 extension
        (set(), "other"),
        ({"neon", "asimd"}, "other"),
    ]
    for extra, host in cases:
        choice = choose(frozenset(_BASE | extra))
        assert choice.host == host, (extra, choice)
        assert choice.cache_dtype == "float32"
        assert choice.reason.startswith(host if host != "other" else "no avx2"), choice.reason


def test_cpu_flags_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_runner_logs_this_hosts_choice_once(caplog):
    cpu_bf16.host_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="runtime.runner.cpu_bf16"):
        assert cache_dtype("bfloat16", "auto") == cpu_bf16.host_choice().cache_dtype
        cache_dtype("bfloat16", "reference")
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime.runner.cpu_bf16"]
    assert len(lines) == 1 and lines[0].startswith("bfloat16 on this CPU ("), lines
    assert cpu_bf16.host_choice().reason in lines[0]
