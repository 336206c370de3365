"""The per-host bfloat16 decision (runtime/runner/cpu_bf16.py), for every kind of host, whatever
CPU runs the tests: the decision is a function of the flags given, not of this machine's."""

import logging

import jax
import numpy as np

from model.base import ModelOptions
from model.config import ModelConfig, from_hf_dict
from model.layers import compute
from model.loader import load_model
from model.testing import DEEPSEEK_TINY, KIMI_TINY, TINY_COMMON, write_tiny_checkpoint
from pallas_kernels.platform import cpu_flags
from pallas_kernels.ragged_paged_attention import native
from runtime.runner import cpu_bf16
from runtime.runner.cpu_bf16 import available_memory, choose, keep_weights_wide
from runtime.runner.model_runner import (
    ModelRunner,
    attention_head_dim,
    cache_dtype,
    choose_weight_dtype,
    model_options,
)

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
        for kernels in (False, True, None):  # None: a model without attention K/V pools
            choice = choose(frozenset(_BASE | extra), native_kernels=kernels)
            assert choice.host == host, (extra, choice)
            assert choice.compute_dtype == compute_dtype, (extra, choice)
            # bf16 caches only where bf16 is native and the C++ kernels serve them
            bf16_cache = kernels is True and compute_dtype == "bfloat16"
            assert choice.cache_dtype == ("bfloat16" if bf16_cache else "float32"), choice
            assert choice.reason.startswith(host if host != "other" else "no avx2"), choice


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
        assert cache_dtype("bfloat16", "auto", 64) == cpu_bf16.host_choice(64).cache_dtype
        cache_dtype("bfloat16", "reference", 64)
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime.runner.cpu_bf16"]
    assert len(lines) == 1 and lines[0].startswith("bfloat16 on this CPU ("), lines
    assert cpu_bf16.host_choice(64).reason in lines[0]


def test_the_runner_widens_bf16_operands_only_on_hosts_without_bf16_dots(monkeypatch):
    hf = {**TINY_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    bf16, f32 = from_hf_dict(hf, dtype="bfloat16"), from_hf_dict(hf, dtype="float32")
    before = compute.widening()
    try:
        for flags, widened in (({"avx2"}, True), ({"avx2", "avx512_bf16"}, False), (set(), True)):
            choice = choose(frozenset(_BASE | flags))
            monkeypatch.setattr(cpu_bf16, "host_choice", lambda head_dim, choice=choice: choice)
            compute.widen_bf16(not widened)
            model_options(bf16, 16, "auto")
            assert compute.widening() is widened, flags
            model_options(f32, 16, "auto")  # a float32 model leaves the choice as it is
            assert compute.widening() is widened, flags
    finally:
        compute.widen_bf16(before)


def test_dense_weights_are_kept_in_f32_only_where_their_copy_fits():
    gib = 2**30
    wide, why = keep_weights_wide(55_000_000, 20 * gib)  # the benchmark Llama, 0.2 GiB in f32
    assert wide and "0.20 GiB" in why and "20.0 GiB available" in why, why
    wide, why = keep_weights_wide(7_000_000_000, 40 * gib)  # 26 GiB in f32: over half of 40
    assert not wide and "26.08 GiB" in why and "stay bf16" in why, why
    assert keep_weights_wide(gib // 8, gib)[0]  # exactly half
    assert not keep_weights_wide(gib // 8 + 1, gib)[0]
    for unknown in ((None, gib), (1000, None)):
        wide, why = keep_weights_wide(*unknown)
        assert not wide and "unknown" in why, why
    # Beside the caches: 0.2 GiB in f32 fits half of 1 GiB, not half of the 0.3 GiB the planned
    # 0.7 GiB of caches leave (used to break: the caches were not counted).
    assert keep_weights_wide(55_000_000, gib)[0]
    wide, why = keep_weights_wide(55_000_000, gib, cache_bytes=gib * 7 // 10)
    assert not wide and "0.3 GiB available beside the caches' 0.70 GiB" in why, why
    assert keep_weights_wide(gib // 16, gib, cache_bytes=gib // 2)[0]  # exactly half of the rest
    assert not keep_weights_wide(1, gib, cache_bytes=2 * gib)[0]  # caches beyond the memory


def test_available_memory_reads_memavailable(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:   12345678 kB\n")
    assert available_memory(info) == 12345678 * 1024
    info.write_text("MemTotal:       24000000 kB\n")
    assert available_memory(info) is None
    assert available_memory(tmp_path / "missing") is None


def test_the_runner_keeps_a_checkpoints_weights_wide_where_they_fit(tmp_path, monkeypatch, caplog):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=1, dtype="bfloat16")
    config = ModelConfig.from_pretrained(path)
    monkeypatch.setattr(
        cpu_bf16, "host_choice", lambda head_dim: choose(frozenset(_BASE | {"avx2"}))
    )
    before = compute.widening(), compute.wide_weights()
    try:
        cases = ((2**34, 0, True), (2**10, 0, False), (None, 0, False), (2**34, 2**34, False))
        for available, caches, wide in cases:
            monkeypatch.setattr(cpu_bf16, "available_memory", lambda available=available: available)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="runtime.runner.model_runner"):
                model_options(config, 16, "auto")
                assert not compute.wide_weights()  # until the caches' bytes are known
                choose_weight_dtype(config, caches)
            assert compute.widening() and compute.wide_weights() is wide, available
            lines = [r.getMessage() for r in caplog.records if "weights kept in" in r.getMessage()]
            assert len(lines) == 1, lines
            assert lines[0].startswith(
                f"bfloat16 weights kept in {'float32' if wide else 'bfloat16'}"
            )
            graphdef, state = load_model(path, config, ModelOptions(block_size=16))
            dense = {a.dtype for a in jax.tree.leaves(state) if a.ndim == 2}
            assert dense == {np.dtype("float32" if wide else "bfloat16")}, (available, dense)
        monkeypatch.setattr(
            cpu_bf16, "host_choice", lambda head_dim: choose(frozenset(_BASE | {"avx512_bf16"}))
        )
        model_options(config, 16, "auto")  # native bf16 dots: nothing widened
        choose_weight_dtype(config, 0)
        assert not compute.widening() and not compute.wide_weights()
    finally:
        compute.widen_bf16(before[0], weights=before[1])


def test_cache_dtype_follows_the_attention_pools_the_kernels_would_serve(monkeypatch):
    """The head dim the C++ kernels are asked for is the model's attention K/V pools' (from its
    cache specs), not its config's head_dim: an MLA model keeps a latent no kernel serves, so a
    bf16 one gets f32 caches even where bf16 caches would be served (it ran 1.44x slower on
    bf16 caches, read through XLA's gathers). Used to break: DeepSeek's config head_dim was
    passed, and a native-bf16 host gave its latent bf16 caches."""

    def config(model_type, architecture, **extra):
        hf = {**TINY_COMMON, **extra, "model_type": model_type, "architectures": [architecture]}
        return from_hf_dict(hf, dtype="bfloat16")

    llama = config("llama", "LlamaForCausalLM", head_dim=48)
    deepseek = config("deepseek_v3", "DeepseekV3ForCausalLM", **DEEPSEEK_TINY)
    kimi = config("kimi_linear", "KimiLinearForCausalLM", **KIMI_TINY)
    assert attention_head_dim(llama, 16) == 48
    # its config's head_dim is one the kernels serve: keyed by it, the latent got bf16 caches
    assert attention_head_dim(deepseek, 16) is None and deepseek.head_dim in native.HEAD_DIMS
    assert attention_head_dim(kimi, 16) is None

    amx = frozenset(_BASE | {"avx2", "avx512_bf16", "amx_bf16"})
    asked = []

    def host(head_dim):
        asked.append(head_dim)
        return choose(amx, None if head_dim is None else True)

    monkeypatch.setattr(cpu_bf16, "host_choice", host)
    before = compute.widening(), compute.wide_weights()
    try:
        assert model_options(llama, 16, "auto").cache_dtype == "bfloat16"
        assert model_options(deepseek, 16, "auto").cache_dtype == "float32"
        assert model_options(kimi, 16, "auto").cache_dtype == "float32"
        assert set(asked) == {48, None}, asked
        assert model_options(deepseek, 16, "pallas").cache_dtype == "bfloat16"  # forced kernel
    finally:
        compute.widen_bf16(before[0], weights=before[1])
    assert "no attention K/V pool" in choose(amx, None).reason


def test_the_runner_counts_its_planned_caches_before_widening_weights(tmp_path, monkeypatch):
    """The runner's own cache plan decides: the same checkpoint and memory keep f32 weights
    beside a small cache and bf16 ones beside a cache that leaves too little room."""
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=2, dtype="bfloat16")
    config = ModelConfig.from_pretrained(path)
    f32_bytes = 4 * sum(
        np.prod(a.shape)
        for a in jax.tree.leaves(load_model(path, config, ModelOptions(block_size=16))[1])
    )
    monkeypatch.setattr(
        cpu_bf16, "host_choice", lambda head_dim: choose(frozenset(_BASE | {"avx2"}))
    )
    available = 8 * f32_bytes
    monkeypatch.setattr(cpu_bf16, "available_memory", lambda: available)
    before = compute.widening(), compute.wide_weights()
    try:
        for cache_bytes, wide in ((f32_bytes // 4, True), (7 * f32_bytes, False)):
            runner = ModelRunner(
                config,
                block_size=16,
                max_model_len=64,
                max_num_seqs=2,
                max_num_batched_tokens=64,
                kv_cache_bytes=cache_bytes,
            )
            planned = runner.kv_cache_bytes + runner.state_cache_bytes
            assert 0 < planned <= cache_bytes, (planned, cache_bytes)
            dense = {a.dtype for a in jax.tree.leaves(runner.params) if a.ndim == 2}
            assert dense == {np.dtype("float32" if wide else "bfloat16")}, (cache_bytes, dense)
    finally:
        compute.widen_bf16(before[0], weights=before[1])
