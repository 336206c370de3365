"""model/sharding.py's layout helpers and the expert-parallel split of the MoE tiles, on one device
(the engines on several simulated devices are tests/runtime/runner/test_tensor_parallel.py's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers.grouped_experts import expert_mlp
from model.sharding import interleave, split_fused


def test_interleave_puts_each_part_slice_on_its_shard_and_split_fused_undoes_it():
    rng = np.random.default_rng(0)
    sizes = (8, 4, 4)  # q, k, v outputs
    w = rng.standard_normal((3, sum(sizes))).astype(np.float32)
    parts = np.split(w, np.cumsum(sizes)[:-1], axis=-1)
    for tp in (1, 2, 4):
        laid = interleave(w, sizes, tp)
        shards = np.split(laid, tp, axis=-1)
        for i, shard in enumerate(shards):
            want = np.concatenate([np.split(p, tp, axis=-1)[i] for p in parts], axis=-1)
            np.testing.assert_array_equal(shard, want)
        for got, part in zip(split_fused(jnp.asarray(laid), sizes, tp), parts, strict=True):
            np.testing.assert_array_equal(np.asarray(got), part)
    np.testing.assert_array_equal(interleave(w, sizes, 1), w)
    # An [out, in] weight's parts lie along axis 0: laid out as its transpose is along the last.
    for tp in (2, 4):
        np.testing.assert_array_equal(
            interleave(w.T, sizes, tp, axis=0), interleave(w, sizes, tp).T
        )


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(1)
    t, h, inter, e, k = 13, 16, 8, 4, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, h, 2 * inter)) * 0.3, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, inter, h)) * 0.3, jnp.float32)
    return x, ids, weights, gate_up, down


def test_an_absent_expert_id_adds_nothing(experts):
    x, ids, weights, gate_up, down = experts
    e = gate_up.shape[0]
    absent = ids == 3
    # Expert 3's pairs named absent (id E) vs. kept with weight 0: the same sum.
    got = jax.jit(expert_mlp)(x, jnp.where(absent, e, ids), weights, gate_up, down)
    want = jax.jit(expert_mlp)(x, ids, jnp.where(absent, 0.0, weights), gate_up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(got).max()) > 0.1


def test_experts_split_over_devices_sum_to_all_experts(experts):
    """The expert-parallel rule of model/layers/moe.py, device by device: each device keeps the
    pairs of its own experts (ids shifted to its local numbering), the rest become absent."""
    x, ids, weights, gate_up, down = experts
    e = gate_up.shape[0]
    whole = np.asarray(jax.jit(expert_mlp)(x, ids, weights, gate_up, down))
    for devices in (2, 4):
        here = e // devices
        total = np.zeros_like(whole)
        for d in range(devices):
            first = d * here
            mine = (ids >= first) & (ids < first + here)
            local = jax.jit(expert_mlp)(
                x,
                jnp.where(mine, ids - first, here),
                jnp.where(mine, weights, 0.0),
                gate_up[first : first + here],
                down[first : first + here],
            )
            total += np.asarray(local)
        np.testing.assert_allclose(total, whole, rtol=1e-5, atol=1e-5)
