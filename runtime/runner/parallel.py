"""The runner's device mesh: which devices serve one engine, and the weights and caches laid out on it.

One engine runs on a mesh of `tensor_parallel_size` devices with axes ("host", "tp")
(model/sharding.py): the processes of a jax.distributed group (1 on one host) by each process's
share of devices. Weights are placed by their family's rule table as they are read from the
checkpoint, so no device ever holds more than its own shards; cache pools are allocated already
split (K/V by KV head; the MLA latent whole on every device). The jitted step then runs under
`jax.set_mesh(mesh)` and JAX's SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model import base, sharding
from model.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


class ParallelSizeError(ConfigError):
    """A parallel layout the devices or the model cannot take; the message has the numbers."""


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A ("host", "tp") mesh of `tensor_parallel_size` devices: every process of the group gives
    the same number of its own devices, in device id order."""
    tp = tensor_parallel_size
    processes = jax.process_count()
    if tp % processes:
        raise ParallelSizeError(
            f"tensor_parallel_size={tp} must be a multiple of the {processes} processes of the "
            "jax.distributed group (each gives the same number of devices)"
        )
    per_process = tp // processes
    local = jax.local_device_count()
    if per_process > local:
        raise ParallelSizeError(
            f"tensor_parallel_size={tp} needs {per_process} devices in each of {processes} "
            f"process{'es' if processes > 1 else ''}, but this process has {local} "
            f"({jax.default_backend()}: {', '.join(str(d) for d in jax.local_devices())})"
        )
    by_process: dict[int, list] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    grid = np.array([by_process[p][:per_process] for p in sorted(by_process)], dtype=object)
    return Mesh(grid, sharding.MESH_AXES)


def placement(
    model_config: ModelConfig, tensor_parallel_size: int, expert_parallel: bool
) -> Placement | None:
    """The engine's placement, or None for one device without expert parallelism (the arrays
    then go to the default device as they always have). Sizes the model cannot split raise
    model.sharding.ShardingError, more devices than there are ParallelSizeError (ConfigErrors)."""
    if tensor_parallel_size == 1 and not expert_parallel:
        return None
    mesh = make_mesh(tensor_parallel_size)  # first: the devices there are
    sharding.check_parallel(model_config, tensor_parallel_size, expert_parallel)
    log.info(
        "tensor_parallel_size=%d%s: mesh %s over %s",
        tensor_parallel_size,
        ", experts split over it" if expert_parallel else "",
        dict(mesh.shape),
        ", ".join(str(d) for d in mesh.devices.flat),
    )
    if model_config.vocab_size % tensor_parallel_size:
        log.info(
            "vocab_size=%d is not a multiple of tensor_parallel_size=%d: the embedding and LM head "
            "are replicated on every device (JAX splits evenly only; padding would change ids)",
            model_config.vocab_size,
            tensor_parallel_size,
        )
    return Placement(mesh, model_config, expert_parallel)


@dataclass(frozen=True)
class Placement:
    """How one engine's arrays sit on its mesh."""

    mesh: Mesh
    model_config: ModelConfig
    expert_parallel: bool

    @property
    def size(self) -> int:
        return self.mesh.size

    def weight(self, path: tuple, array: np.ndarray) -> jax.Array:
        """One parameter, as the loader reads it, put on the mesh by its family's rule: a fused
        weight laid out shard by shard first (model/sharding.py `interleave`)."""
        rules = sharding.weight_rules(self.model_config, self.size, self.expert_parallel)
        rule = sharding.rule_for(rules, path)
        spec = P() if rule is None else P(*rule.spec)
        if rule is not None and rule.fused:
            array = sharding.interleave(array, rule.fused, self.size, rule.axis)
        target = NamedSharding(self.mesh, spec)
        # From a callback so that, across processes, each one fills only its own devices' shards.
        return jax.make_array_from_callback(array.shape, target, lambda index: array[index])

    def host_inputs(self, tree):
        """Host arrays (the batch, the sampling rows) for the jitted step. One process passes
        numpy arrays as they are (the call's own transfer is the cheapest); in a group of
        processes each puts its own copy, the same in every process (the agreement check of
        runtime/runner/multihost.py has confirmed the schedule they come from), on its devices."""
        if jax.process_count() == 1:
            return tree
        whole = NamedSharding(self.mesh, P())

        def put(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, whole, lambda index: x[index])

        return jax.tree_util.tree_map(put, tree)

    def cache_shardings(self, specs: Sequence[base.CacheSpec]) -> tuple:
        """The sharding of every array of `base.allocate(specs, ...)`, in its structure."""
        out = []
        for spec in specs:
            split = sharding.cache_partition(self.model_config, spec.name)
            target = NamedSharding(self.mesh, P(*split))
            out += [tuple(target for _ in spec.parts) for _ in range(spec.num_layers)]
        return tuple(out)

    def allocate(self, specs: Sequence[base.CacheSpec], num_blocks: int, num_slots: int) -> tuple:
        """`base.allocate`, each array created already split over the mesh."""
        make = jax.jit(
            lambda: base.allocate(specs, num_blocks, num_slots),
            out_shardings=self.cache_shardings(specs),
        )
        return make()


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds of the arrays in `tree`, by device id (this process's devices)."""
    held: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def memory_report(params, caches) -> str:
    """Per device: weight and KV cache bytes (logged at start-up)."""
    weights, kv = bytes_per_device(params), bytes_per_device(caches)
    return "; ".join(
        f"device {d}: weights {weights.get(d, 0)} bytes ({weights.get(d, 0) / 2**20:.1f} MiB), "
        f"KV cache {kv.get(d, 0)} bytes ({kv.get(d, 0) / 2**20:.1f} MiB)"
        for d in sorted(set(weights) | set(kv))
    )
