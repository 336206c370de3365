"""Tensor and expert parallelism: how each family's weights and caches are split over a device mesh.

The mesh (built by runtime/runner/parallel.py) has two axes, `("host", "tp")`: the processes of a
multi-host group and each process's devices. The tensor-parallel group is the whole mesh, so the
rules below name both axes (`GROUP`): four devices on one host and two on each of two hosts are the
same layout to the model, and JAX picks the collectives.

The runner traces the model under `jax.set_mesh(mesh)`; the layers read the mesh from there
(`group_size`, `on_each_device`, `replicated`), so a model traced without a mesh is the
one-device model. Weights are placed by the rule table of their family (`weight_rules`, one regex
over the '/'-joined parameter path per row), the layout vLLM's parallel linears use:

- attention: q heads and KV heads over the group (the fused q/k/v outputs and the o_proj inputs), so
  T must divide the KV heads (vLLM would replicate KV heads instead; we refuse);
- MLP and shared experts: the intermediate over the group (gate/up outputs, down_proj inputs);
- routed experts: the intermediate over the group, or with `expert_parallel` whole experts;
- embedding and LM head: by vocabulary rows (replicated when T does not divide the vocabulary);
- MLA (DeepSeek): q heads over the group (q_b_proj / q_proj outputs, kv_b_proj outputs, o_proj
  inputs); the latent projection and the latent cache are replicated, as in vLLM.

A fused projection (q/k/v, gate/up) keeps its parts side by side on the output axis. Split into T
contiguous shards that would give one device all of q and another all of v, so the loader lays a
fused weight out shard by shard (`interleave`: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]) and the layer
splits its output the same way (`split_fused`). With T = 1 both are the identity: the one-device
layout is unchanged.

Each input-split matmul leaves partial sums that one all-reduce adds up: two per Llama layer (o_proj,
down_proj), plus one for the vocabulary-split embedding lookup; the logits are gathered once, for
sampling (`replicated`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from model.config import ConfigError

HOST, DEVICE = "host", "tp"
MESH_AXES = (HOST, DEVICE)
GROUP = MESH_AXES  # a PartitionSpec entry: split over the whole tensor-parallel group


class ShardingError(ConfigError):
    """A parallel layout the model's sizes cannot take (the numbers are in the message)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """Parameters whose '/'-joined path matches `pattern` are split by `spec` (one entry per array
    axis: GROUP or None). `fused`: the sizes of the parts joined along the split axis, laid out
    shard by shard (`interleave`)."""

    pattern: str
    spec: tuple
    fused: tuple[int, ...] = ()

    @property
    def axis(self) -> int:
        """The axis split over the group."""
        return self.spec.index(GROUP)


# The mesh the model is traced under.


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != MESH_AXES:
        return None
    return mesh


def on_mesh() -> bool:
    """Whether the model is being traced under a tensor-parallel mesh."""
    return _mesh() is not None


def group_size() -> int:
    """Devices of the tensor-parallel group of the mesh being traced under (1 without one)."""
    mesh = _mesh()
    return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in MESH_AXES]))


def on_each_device(fn: Callable, in_specs, out_specs) -> Callable:
    """`fn` run once per device on its shards (`jax.shard_map`), for code XLA must not partition on
    its own: Pallas kernels, the expert tiles' data-dependent scan. Without a mesh, `fn` itself."""
    mesh = _mesh()
    if mesh is None:
        return fn
    # check_vma off: the Pallas kernels have no replication rules, and every out_spec here is
    # either split or the result of a psum.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def replicated(tree):
    """The arrays of `tree` whole on every device (the logits, once per step, before sampling;
    the sampled tokens, which every process reads)."""
    if _mesh() is None:
        return tree
    return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def split_fused(y: jax.Array, sizes: Sequence[int], tp: int) -> list[jax.Array]:
    """The parts of a fused projection's output [..., sum(sizes)], laid out shard by shard for a
    group of `tp` (see `interleave`), each as [..., size] in its own order."""
    lead = y.shape[:-1]
    per = [s // tp for s in sizes]
    y = y.reshape(*lead, tp, sum(per))
    bounds = np.cumsum([0, *per])
    return [
        y[..., a:b].reshape(*lead, s)
        for a, b, s in zip(bounds[:-1], bounds[1:], sizes, strict=True)
    ]


def interleave(array: np.ndarray, sizes: Sequence[int], tp: int, axis: int = -1) -> np.ndarray:
    """A fused weight with `sizes` parts side by side along `axis` laid out shard by shard along
    it: shard i is [part_0 block i | part_1 block i | ...], so a contiguous split over `tp`
    devices gives each device its slice of every part. The identity for tp = 1."""
    if tp == 1:
        return array
    moved = np.moveaxis(array, axis, -1)
    lead = moved.shape[:-1]
    bounds = np.cumsum([0, *sizes])
    parts = [
        moved[..., a:b].reshape(*lead, tp, (b - a) // tp)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    laid = np.concatenate(parts, axis=-1).reshape(*lead, sum(sizes))
    return np.moveaxis(laid, -1, axis)


# Per-family rule tables.


def _llama_rules(config, tp: int, expert_parallel: bool) -> tuple[Rule, ...]:
    d = config.head_dim
    nq, nkv = config.num_attention_heads * d, config.num_key_value_heads * d
    inter = config.intermediate_size
    return (
        *_vocab_rules(config, tp),
        Rule(r"self_attn/qkv_proj/weight", (GROUP, None), (nq, nkv, nkv)),
        Rule(r"self_attn/qkv_proj/bias", (GROUP,), (nq, nkv, nkv)),
        Rule(r"self_attn/o_proj/weight", (None, GROUP)),
        Rule(r"mlp/gate_up_proj/weight", (GROUP, None), (inter, inter)),
        Rule(r"mlp/gate_up_proj/bias", (GROUP,), (inter, inter)),
        Rule(r"mlp/down_proj/weight", (None, GROUP)),
    )


def _deepseek_rules(config, tp: int, expert_parallel: bool) -> tuple[Rule, ...]:
    from model.layers.moe import moe_settings

    inter = config.intermediate_size
    rules = [
        *_vocab_rules(config, tp),
        # MLA: the per-head projections; the latent path stays replicated.
        Rule(r"self_attn/(q_proj|q_b_proj)/weight", (GROUP, None)),
        Rule(r"self_attn/kv_b_proj/weight", (GROUP, None)),
        Rule(r"self_attn/o_proj/weight", (None, GROUP)),
        # Dense layers (below first_k_dense_replace).
        Rule(r"^model/layers/\d+/mlp/gate_up_proj/weight", (GROUP, None), (inter, inter)),
        Rule(r"^model/layers/\d+/mlp/down_proj/weight", (None, GROUP)),
    ]
    if "n_routed_experts" in config.hf_config or "moe_intermediate_size" in config.hf_config:
        s = moe_settings(config)
        shared = s.n_shared_experts * s.moe_intermediate_size
        moe_inter = s.moe_intermediate_size
        rules += [
            Rule(r"mlp/shared_experts/gate_up_proj/weight", (GROUP, None), (shared, shared)),
            Rule(r"mlp/shared_experts/down_proj/weight", (None, GROUP)),
        ]
        if expert_parallel:
            rules += [
                Rule(r"mlp/experts_gate_up", (GROUP, None, None)),
                Rule(r"mlp/experts_down", (GROUP, None, None)),
            ]
        else:
            rules += [
                Rule(r"mlp/experts_gate_up", (None, None, GROUP), (moe_inter, moe_inter)),
                Rule(r"mlp/experts_down", (None, GROUP, None)),
            ]
    return tuple(rules)


def _vocab_rules(config, tp: int) -> tuple[Rule, ...]:
    if config.vocab_size % tp:
        return ()  # replicated: JAX splits only evenly, and padding the vocabulary changes ids
    return (
        Rule(r"^model/embed_tokens/weight$", (GROUP, None)),
        Rule(r"^lm_head/weight$", (GROUP, None)),
    )


# Architecture -> (weight rules, cache spec name -> page partition). A family absent here runs on
# one device only (check_parallel refuses T > 1 for it).
_FAMILIES: dict[str, tuple[Callable, dict[str, tuple]]] = {
    "LlamaForCausalLM": (_llama_rules, {"attention K/V": (None, None, GROUP, None)}),
    "Qwen2ForCausalLM": (_llama_rules, {"attention K/V": (None, None, GROUP, None)}),
    "Qwen3ForCausalLM": (_llama_rules, {"attention K/V": (None, None, GROUP, None)}),
    # MLA latent replicated (one shared latent head), as vLLM keeps it.
    "DeepseekV3ForCausalLM": (_deepseek_rules, {"MLA latent": ()}),
}


def weight_rules(config, tp: int, expert_parallel: bool) -> tuple[Rule, ...]:
    rules, _ = _FAMILIES[config.architecture]
    return rules(config, tp, expert_parallel)


def rule_for(rules: Sequence[Rule], path: tuple) -> Rule | None:
    """The first rule matching a parameter path (None: replicated)."""
    name = "/".join(str(p) for p in path)
    for rule in rules:
        if re.search(rule.pattern, name):
            return rule
    return None


def cache_partition(config, spec_name: str) -> tuple:
    """How one pool's arrays [num_blocks, *page_shape] are split (() = replicated)."""
    _, pools = _FAMILIES[config.architecture]
    return pools[spec_name]


def check_parallel(config, tp: int, expert_parallel: bool) -> None:
    """ShardingError naming every size that `tp` devices cannot split (or the family without a
    rule table); nothing for tp = 1 without expert parallelism."""
    arch = config.architecture
    if tp == 1 and not expert_parallel:
        return
    if arch not in _FAMILIES:
        raise ShardingError(
            f"{arch} has no tensor-parallel layout yet (tensor_parallel_size={tp}, "
            f"enable_expert_parallel={expert_parallel}); families with one: "
            + ", ".join(sorted(_FAMILIES))
        )
    hf = config.hf_config
    moe = arch.startswith("Deepseek") and "n_routed_experts" in hf
    if expert_parallel and not moe:
        raise ShardingError(f"enable_expert_parallel=True: {arch} at {config.path} has no experts")
    sizes = [("num_attention_heads", config.num_attention_heads)]
    if arch.startswith("Deepseek"):
        sizes.append(("intermediate_size", config.intermediate_size))
        if moe:
            from model.layers.moe import moe_settings

            s = moe_settings(config)
            sizes.append(
                (
                    "n_shared_experts * moe_intermediate_size",
                    s.n_shared_experts * s.moe_intermediate_size,
                )
            )
            if expert_parallel:
                sizes.append(("n_routed_experts", s.n_routed_experts))
            else:
                sizes.append(("moe_intermediate_size", s.moe_intermediate_size))
    else:
        sizes += [
            ("num_key_value_heads", config.num_key_value_heads),
            ("intermediate_size", config.intermediate_size),
        ]
    bad = [f"{name}={value}" for name, value in sizes if value % tp]
    if bad:
        raise ShardingError(
            f"tensor_parallel_size={tp} must divide {', '.join(bad)} of {arch} ({config.path}); "
            "sizes that divide all of them: "
            + ", ".join(str(t) for t in range(1, tp) if all(v % t == 0 for _, v in sizes))
        )
