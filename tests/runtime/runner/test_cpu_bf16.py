"""The per-host bfloat16 decision (runtime/runner/cpu_bf16.py), for every kind of host, whatever
CPU runs the tests: the decision is a function of the flags given, not of this machine's."""

import logging

from model.config import from_hf_dict
from model.layers import compute
from model.testing import TINY_COMMON
from runtime.runner import cpu_bf16
from runtime.runner.cpu_bf16 import choose, cpu_flags
from runtime.runner.model_runner import cache_dtype, model_options

_BASE = {"fpu", "sse2", "avx", "fma"}


def test_each_host_kind_gets_its_choice_and_reason():
    cases = [  # flags, host kind, what bf16 operands are computed in
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx_bf16", "bfloat16"),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16", "bfloat16"),
        ({"avx2"}, "avx2", "float32"),
        ({"avx2", "avx512f"}, "avx2", "float32"),  # AVX-512 without its bf16 extension
        (set(), "other", "float32"),
        ({"neon", "asimd"}, "other", "float32"),
    ]
    for extra, host, compute_dtype in cases:
        choice = choose(frozenset(_BASE | extra))
        assert choice.host == host, (extra, choice)
        assert choice.compute_dtype == compute_dtype, (extra, choice)
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


def test_the_runner_widens_bf16_operands_only_on_hosts_without_bf16_dots(monkeypatch):
    hf = {**TINY_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    bf16, f32 = from_hf_dict(hf, dtype="bfloat16"), from_hf_dict(hf, dtype="float32")
    before = compute.widening()
    try:
        for flags, widened in (({"avx2"}, True), ({"avx2", "avx512_bf16"}, False), (set(), True)):
            choice = choose(frozenset(_BASE | flags))
            monkeypatch.setattr(cpu_bf16, "host_choice", lambda choice=choice: choice)
            compute.widen_bf16(not widened)
            model_options(bf16, 16, "auto")
            assert compute.widening() is widened, flags
            model_options(f32, 16, "auto")  # a float32 model leaves the choice as it is
            assert compute.widening() is widened, flags
    finally:
        compute.widen_bf16(before)
