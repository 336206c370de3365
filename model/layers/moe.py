"""DeepSeek-V3 mixture of experts: sigmoid router with group-limited top-k, routed experts run as one
grouped computation (model/layers/grouped_experts.py), shared experts added. Matches HF transformers'
`DeepseekV3MoE` / `DeepseekV3TopkRouter`.

Ties. Experts whose biased scores are exactly equal are ordered by index, the lower first
(`jax.lax.top_k`'s documented rule; the same for groups whose scores tie). torch's CPU `topk`, which
HF uses, documents no order among equal values and in practice does not pick the lowest index, so on
an exact tie HF may route to a different (equally scored) expert. Ties need equal router logits, e.g.
two experts with identical gate rows, or an all-zero hidden state with equal correction biases.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.config import ConfigError, ModelConfig
from model.layers.grouped_experts import expert_mlp
from model.layers.linear import project
from model.layers.mlp import GatedMLP, gated
from model.sharding import GROUP, on_each_device, on_mesh
from model.weight_spec import WeightSpec

# HF's DeepseekV3Config defaults, used where config.json leaves a key out.
_HF_DEFAULTS = dict(
    n_routed_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
# What HF's DeepseekV3TopkRouter computes (it ignores these keys; DeepSeek's own configs carry them,
# and DeepSeek-V2's softmax / greedy routers name other values).
_SCORING_FUNC = "sigmoid"
_TOPK_METHOD = "noaux_tc"


@dataclass(frozen=True, slots=True)
class MoeSettings:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def moe_settings(
    config: ModelConfig,
    *,
    names: Mapping[str, str] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> MoeSettings:
    """The MoE keys of config.json, checked: a ConfigError names any field vlax cannot serve.

    A family whose config.json spells the keys otherwise (Kimi-Linear's `num_experts` for
    `n_routed_experts`, ...) passes `names` (DeepSeek's key -> its own) and its own `defaults`
    (by DeepSeek's key) for keys its config.json may leave out.
    """
    hf = config.hf_config
    names = names or {}
    defaults = _HF_DEFAULTS if defaults is None else defaults

    def field(key):
        name = names.get(key, key)
        return hf[name] if name in hf else defaults[key]

    def refuse(key, value, expected):
        raise ConfigError(
            f"{config.path}: MoE config field {names.get(key, key)!r} = {value!r}; "
            f"expected {expected}"
        )

    for key, wanted in (("scoring_func", _SCORING_FUNC), ("topk_method", _TOPK_METHOD)):
        value = hf.get(names.get(key, key))
        if value is not None and value != wanted:
            refuse(key, value, f"{wanted!r} (the DeepSeek-V3 router)")
    ints = {}
    for key in (
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        "n_group",
        "topk_group",
    ):
        v = field(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            refuse(key, v, "a positive int")
        ints[key] = v
    experts, groups = ints["n_routed_experts"], ints["n_group"]
    if experts % groups:
        refuse("n_routed_experts", experts, f"a multiple of n_group ({groups})")
    if experts // groups < 2:
        # Each group is scored by the sum of its top-2 experts.
        refuse("n_group", groups, f"at most n_routed_experts / 2 ({experts // 2})")
    if ints["topk_group"] > groups:
        refuse("topk_group", ints["topk_group"], f"at most n_group ({groups})")
    selectable = ints["topk_group"] * (experts // groups)
    if ints["num_experts_per_tok"] > selectable:
        refuse(
            "num_experts_per_tok",
            ints["num_experts_per_tok"],
            f"at most topk_group * n_routed_experts / n_group ({selectable})",
        )
    scaling = field("routed_scaling_factor")
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool):
        refuse("routed_scaling_factor", scaling, "a number")
    return MoeSettings(
        **ints, norm_topk_prob=bool(field("norm_topk_prob")), routed_scaling_factor=float(scaling)
    )


def route(
    logits: jax.Array,
    correction_bias: jax.Array,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] (float32) -> (expert ids int32 [T, top_k], weights float32 [T, top_k]).

    The correction bias only chooses: groups are ranked by the sum of their two best biased scores,
    the top `topk_group` groups are kept, the top `top_k` experts are chosen among them by biased
    score, and each is weighted by its un-biased sigmoid score (normalised over the chosen ones if
    `norm_topk_prob`, then times `routed_scaling_factor`). Ids come in descending biased score,
    ties by lower index.
    """
    num_tokens, num_experts = logits.shape
    per_group = num_experts // n_group
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)
    best_two = jax.lax.top_k(choice.reshape(num_tokens, n_group, per_group), 2)[0]
    _, kept_groups = jax.lax.top_k(best_two.sum(-1), topk_group)
    group_kept = jnp.zeros((num_tokens, n_group), bool)
    group_kept = group_kept.at[jnp.arange(num_tokens)[:, None], kept_groups].set(True)
    expert_kept = jnp.repeat(group_kept, per_group, axis=1)
    _, ids = jax.lax.top_k(jnp.where(expert_kept, choice, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * jnp.float32(routed_scaling_factor)


class DeepseekMoE(nnx.Module):
    """x [T, hidden] -> routed experts (weighted by the router) + shared experts, [T, hidden]."""

    def __init__(
        self,
        config: ModelConfig,
        dtype,
        settings: MoeSettings | None = None,
        *,
        expert_parallel: bool = False,
    ):
        s = moe_settings(config) if settings is None else settings
        self.settings = s
        h, e, inter = config.hidden_size, s.n_routed_experts, s.moe_intermediate_size
        # HF keeps the router in float32 whatever the model dtype (_keep_in_fp32_modules_strict).
        self.router_kernel = nnx.Param(jnp.zeros((h, e), jnp.float32))
        self.score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        # Experts stacked on a leading axis, kernels [in, out]; gate and up fused.
        self.experts_gate_up = nnx.Param(jnp.zeros((e, h, 2 * inter), dtype))
        self.experts_down = nnx.Param(jnp.zeros((e, inter, h), dtype))
        self.shared_experts = GatedMLP(h, s.n_shared_experts * inter, bias=False, dtype=dtype)
        # Under a mesh: whole experts split over the devices, else their intermediate.
        self.expert_parallel = expert_parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.settings
        # Full f32 precision: a TF32 router logit can flip a near-tie that HF (f32) resolves.
        logits = jnp.dot(
            x.astype(jnp.float32), self.router_kernel[...], precision=jax.lax.Precision.HIGHEST
        )
        ids, weights = route(
            logits,
            self.score_correction_bias[...],
            top_k=s.num_experts_per_tok,
            n_group=s.n_group,
            topk_group=s.topk_group,
            norm_topk_prob=s.norm_topk_prob,
            routed_scaling_factor=s.routed_scaling_factor,
        )
        if not on_mesh():
            routed = expert_mlp(x, ids, weights, self.experts_gate_up[...], self.experts_down[...])
            return routed + self.shared_experts(x)
        # Per device: its experts (or its slice of every expert) and its slice of the shared
        # experts, summed over the devices by one all-reduce.
        if self.expert_parallel:
            gate_up, down = P(GROUP, None, None), P(GROUP, None, None)
        else:
            gate_up, down = P(None, None, GROUP), P(None, GROUP, None)
        run = on_each_device(
            functools.partial(_experts_here, expert_parallel=self.expert_parallel),
            in_specs=(P(), P(), P(), gate_up, down, P(GROUP, None), P(None, GROUP)),
            out_specs=P(),
        )
        shared = self.shared_experts
        return run(
            x,
            ids,
            weights,
            self.experts_gate_up[...],
            self.experts_down[...],
            shared.gate_up_proj.weight[...],
            shared.down_proj.weight[...],
        )


def _experts_here(x, ids, weights, gate_up, down, shared_gate_up, shared_down, *, expert_parallel):
    """One device's part of the MoE output, all-reduced: its routed experts (expert parallel:
    the pairs of other devices' experts are dropped) or its slice of every expert's
    intermediate, plus its slice of the shared experts (fused gate/up laid out per device,
    model/sharding.py, so each local weight is [gate slice | up slice])."""
    if expert_parallel:
        here = gate_up.shape[0]
        first = jax.lax.axis_index(GROUP) * here
        mine = (ids >= first) & (ids < first + here)
        ids = jnp.where(mine, ids - first, here)  # `here`: no expert of this device
        weights = jnp.where(mine, weights, 0.0)
    out = expert_mlp(x, ids, weights, gate_up, down) + _gated_mlp(x, shared_gate_up, shared_down)
    return jax.lax.psum(out, GROUP)


def _gated_mlp(x, gate_up, down):
    """GatedMLP's computation (no bias) on [out, in] weights given as arrays."""
    h = project(x, gate_up).astype(x.dtype)
    n = h.shape[-1] // 2
    return project(gated(h[:, :n], h[:, n:]), down).astype(x.dtype)


def moe_weight_specs(
    module_path: tuple,
    hf_prefix: str,
    config: ModelConfig,
    settings: MoeSettings | None = None,
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> tuple[WeightSpec, ...]:
    """Where each DeepseekMoE parameter comes from on disk (per-expert tensors, HF's hub layout):
    `module_path` is the module's path in the model's nnx state, `hf_prefix` e.g.
    "model.layers.3.mlp". A family whose checkpoints name the routed experts' gate, up and down
    projections otherwise (Kimi-Linear's w1, w3, w2) passes `expert_names`, and its `settings`."""
    s = moe_settings(config) if settings is None else settings
    h, e, inter = config.hidden_size, s.n_routed_experts, s.moe_intermediate_size
    shared = s.n_shared_experts * inter
    p = hf_prefix
    gate, up, down = expert_names
    expert = [f"{p}.experts.{n}." for n in range(e)]
    return (
        WeightSpec((*module_path, "router_kernel"), ((f"{p}.gate.weight", (e, h)),), True),
        WeightSpec(
            (*module_path, "score_correction_bias"), ((f"{p}.gate.e_score_correction_bias", (e,)),)
        ),
        WeightSpec(
            (*module_path, "experts_gate_up"),
            tuple((f"{x}{name}.weight", (inter, h)) for x in expert for name in (gate, up)),
            True,
            stacked=e,
        ),
        WeightSpec(
            (*module_path, "experts_down"),
            tuple((f"{x}{down}.weight", (h, inter)) for x in expert),
            True,
            stacked=e,
        ),
        WeightSpec(
            (*module_path, "shared_experts", "gate_up_proj", "weight"),
            (
                (f"{p}.shared_experts.gate_proj.weight", (shared, h)),
                (f"{p}.shared_experts.up_proj.weight", (shared, h)),
            ),
        ),
        WeightSpec(
            (*module_path, "shared_experts", "down_proj", "weight"),
            ((f"{p}.shared_experts.down_proj.weight", (h, shared)),),
        ),
    )
