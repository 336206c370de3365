"""The gated MLP computing its rows in parts on the CPU (model/layers/compute.py `row_parts`,
the limit from runtime/runner/host_cache.py): how rows are split, that a split MLP gives the
unsplit one's values, and how the cache size is read from sysfs."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import from_hf_dict
from model.layers import compute
from model.layers.mlp import GatedMLP
from model.testing import TINY_COMMON
from runtime.runner import host_cache
from runtime.runner.host_cache import last_level_cache_bytes
from runtime.runner.model_runner import model_options


@pytest.fixture
def limit():
    """Sets the process-wide limit within one test, leaving none afterwards."""
    yield compute.limit_activation_bytes
    compute.limit_activation_bytes(None)


def covers(parts, rows):
    return (
        parts[0][0] == 0
        and parts[-1][1] == rows
        and all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    )


def test_row_parts_split_evenly_under_the_limit_and_never_below_the_floor(limit):
    limit(None)
    assert compute.row_parts(4096, 1 << 20) == [(0, 4096)]
    limit(32 << 20)
    assert compute.row_parts(2048, 16384) == [(0, 2048)]  # exactly the limit: one part
    assert compute.row_parts(4096, 16384) == [(0, 2048), (2048, 4096)]
    assert compute.row_parts(4097, 16384) == [(0, 1366), (1366, 2732), (2732, 4097)]
    assert compute.row_parts(3000, 11264) == [(0, 1500), (1500, 3000)]
    # a row wider than the limit: parts of MIN_PART_ROWS rows, the last one shorter
    floor = compute.MIN_PART_ROWS
    parts = compute.row_parts(floor * 2 + 7, 64 << 20)
    assert parts == [(0, floor), (floor, 2 * floor), (2 * floor, 2 * floor + 7)]
    for rows in (1, 513, 1000, 4096, 8191):
        for row_bytes in (4, 16384, 100_000):
            parts = compute.row_parts(rows, row_bytes)
            assert covers(parts, rows), (rows, row_bytes, parts)
            sizes = [b - a for a, b in parts]
            assert len(parts) == 1 or min(sizes[:-1]) >= floor, (rows, row_bytes, parts)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_split_mlp_gives_the_unsplit_values(limit, monkeypatch, act):
    monkeypatch.setattr(compute, "MIN_PART_ROWS", 8)
    hidden, inter = 24, 40
    mlp = GatedMLP(hidden, inter, bias=True, dtype=jnp.float32, act=act)
    rng = np.random.default_rng(3)
    for _, param in nnx.iter_graph(mlp):
        if isinstance(param, nnx.Param):
            param[...] = jnp.asarray(rng.standard_normal(param.shape) * 0.2, jnp.float32)
    graph, state = nnx.split(mlp)

    @jax.jit
    def run(state, x):
        return nnx.merge(graph, state)(x)

    row_bytes = 2 * inter * 4
    for rows in (8, 9, 31, 64, 77):
        x = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
        limit(None)
        whole = run(state, x)
        limit(row_bytes * 8)  # parts of 8 rows
        parts = compute.row_parts(rows, row_bytes)
        assert len(parts) == -(-rows // 8), rows
        split = jax.jit(lambda s, x: nnx.merge(graph, s)(x))
        text = split.lower(state, x).as_text()
        assert text.count("dot_general") == 2 * len(parts), rows
        # The same products, summed by dots of other row counts: equal to f32 rounding.
        np.testing.assert_allclose(split(state, x), whole, rtol=1e-5, atol=1e-6, err_msg=str(rows))


def test_last_level_cache_read_from_sysfs(tmp_path):
    def index(n, level, kind, size):
        d = tmp_path / f"index{n}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")

    assert last_level_cache_bytes(tmp_path) is None
    index(0, 1, "Data", "48K")
    index(1, 1, "Instruction", "32K")
    index(2, 2, "Unified", "2048K")
    assert last_level_cache_bytes(tmp_path) == 2 << 20
    index(3, 3, "Unified", "32768K")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    index(4, 4, "Instruction", "64M")  # an instruction cache is never the data's
    (tmp_path / "index5").mkdir()  # unreadable: skipped
    assert last_level_cache_bytes(tmp_path) == 32 << 20


def test_the_cpu_runner_limits_activations_to_the_hosts_cache(limit, monkeypatch, caplog):
    hf = {**TINY_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    config = from_hf_dict(hf, dtype="float32")
    host_cache.activation_limit.cache_clear()
    monkeypatch.setattr(host_cache, "last_level_cache_bytes", lambda: 24 << 20)
    with caplog.at_level(logging.INFO, logger="runtime.runner.host_cache"):
        model_options(config, 16, "auto")
        model_options(config, 16, "auto")
    host_cache.activation_limit.cache_clear()
    assert compute.row_parts(3 << 10, 16 << 10) == [(0, 1536), (1536, 3072)]
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime.runner.host_cache"]
    assert lines == [
        "CPU last-level cache 24 MiB: a gated MLP computes its rows in parts whose "
        "intermediate fits it"
    ]
