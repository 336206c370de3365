"""Kimi-Linear: KDA layers (model/layers/kda.py) and MLA layers without rope, with DeepSeek's MoE.

Implements the model protocol of model/base.py, following HF's `KimiLinearForCausalLM`. Each layer
is `linear_attention` (KDA) or `full_attention` (MLA, model/layers/mla.py, with `mla_use_nope`: no
rope anywhere, the KDA layers' decay carries position); its MLP is a dense SwiGLU or the
sigmoid-routed MoE with shared experts (model/layers/moe.py: HF's KimiLinearTopkRouter routes as
DeepseekV3TopkRouter does).

Two caches: the paged "MLA latent" pool of the full-attention layers, and the "KDA state" slots of
the KDA layers (a recurrent state and a conv tail per layer and request, base.StateCacheSpec).

Config. Hub checkpoints write `linear_attn_config` (1-based `kda_layers` / `full_attn_layers`,
`num_heads`, `head_dim`, `short_conv_kernel_size`) and DeepSeek's MoE keys renamed (`num_experts`,
`num_experts_per_token`, `num_shared_experts`, `num_expert_group`, `moe_renormalize`,
`moe_router_activation_func`, `model_max_length`); transformers writes `layer_types`,
`mlp_layer_types` and `linear_*` instead. Both are read, with HF's precedence and defaults.
Newer fields: `gate_lower_bound` is served (the bounded gate, kernels.md A.1);
`use_full_rank_gate` and `mla_use_output_gate` change weights HF's Kimi-Linear does not have and are
refused by name when true, as is `mla_use_nope: false` (rope in MLA).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from model.base import ModelOptions, PagedCacheSpec, StateCacheSpec
from model.batch import ModelBatch
from model.config import ConfigError, ModelConfig
from model.deepseek import DeepseekV3ForCausalLM
from model.layers.decoder import DecoderStack, PreNormLayer, head_logits, own_lm_head
from model.layers.kda import KDAShape, KimiDeltaAttention
from model.layers.mla import MLAShape, MLAttention, choose_backend
from model.layers.mlp import GatedMLP
from model.layers.moe import DeepseekMoE, MoeSettings, moe_settings, moe_weight_specs
from model.weight_spec import (
    WeightSpec,
    embedding_spec,
    gated_mlp_specs,
    head_specs,
    layer_norm_specs,
    past_last_layer,
)
from pallas_kernels import kda as kda_ops

KDA, MLA = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
# HF's KimiLinearConfig defaults, for keys a config.json leaves out.
_LINEAR_DEFAULTS = dict(head_dim=128, num_heads=32, short_conv_kernel_size=4)
_MOE_DEFAULTS = dict(
    n_routed_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=1024,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
)
# DeepSeek's MoE key -> its spellings in Kimi configs (hub first, then transformers').
_MOE_ALIASES = dict(
    n_routed_experts=("num_experts", "num_local_experts", "n_routed_experts"),
    num_experts_per_tok=("num_experts_per_token", "num_experts_per_tok"),
    n_shared_experts=("num_shared_experts", "n_shared_experts"),
    n_group=("num_expert_group", "n_group"),
    norm_topk_prob=("moe_renormalize", "norm_topk_prob"),
    scoring_func=("moe_router_activation_func", "scoring_func"),
)


@dataclasses.dataclass(frozen=True, slots=True)
class KimiSettings:
    layer_types: tuple[str, ...]  # KDA or MLA per layer
    mlp_types: tuple[str, ...]  # DENSE or SPARSE per layer
    kda: KDAShape
    moe: MoeSettings | None  # None when no layer is sparse

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


def kimi_settings(config: ModelConfig) -> KimiSettings:
    """The Kimi-specific keys of config.json, checked; a ConfigError names any field not served."""
    hf = config.hf_config
    linear = hf.get("linear_attn_config") or {}

    def refuse(field, value, why):
        raise ConfigError(f"{config.path}: config field {field!r} = {value!r}: {why}")

    def linear_field(key: str, top_level: str):
        value = linear.get(key, hf.get(top_level, _LINEAR_DEFAULTS[key]))
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            refuse(f"linear_attn_config.{key}", value, "expected a positive int")
        return value

    for field in ("use_full_rank_gate", "mla_use_output_gate"):
        places = ((field, hf.get(field)), (f"linear_attn_config.{field}", linear.get(field)))
        for where, value in places:
            if value:
                refuse(
                    where,
                    value,
                    "not served (it changes the layer's weights and HF's Kimi-Linear, vlax's "
                    "oracle, has no such layer); use a checkpoint without it",
                )
    if hf.get("mla_use_nope") is False:
        refuse(
            "mla_use_nope",
            False,
            "Kimi-Linear's MLA layers are served without rope only (HF and vLLM run them so)",
        )
    if hf.get("moe_layer_freq", 1) != 1:
        refuse(
            "moe_layer_freq",
            hf.get("moe_layer_freq"),
            "only 1 is served (every layer past first_k_dense_replace is MoE, as HF runs it)",
        )
    bound = linear.get("gate_lower_bound", hf.get("gate_lower_bound"))
    if bound is not None and (
        isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -5.0 <= bound <= 0.0
    ):
        refuse("gate_lower_bound", bound, "expected a number in [-5, 0] or null")
    conv = linear_field("short_conv_kernel_size", "linear_conv_kernel_dim")
    if conv < 2:
        refuse("linear_attn_config.short_conv_kernel_size", conv, "expected at least 2")
    kda = KDAShape(
        hidden_size=config.hidden_size,
        num_heads=linear_field("num_heads", "linear_num_heads"),
        head_dim=linear_field("head_dim", "linear_head_dim"),
        conv_size=conv,
        gate_lower_bound=None if bound is None else float(bound),
        norm_eps=config.rms_norm_eps,
    )
    layer_types = _layer_types(config, linear, refuse)
    mlp_types = _mlp_types(config, refuse)
    if MLA not in layer_types:
        refuse("layer_types", list(layer_types), "needs at least one full_attention (MLA) layer")
    if SPARSE not in mlp_types:
        moe = None
    else:
        names = {
            key: next((a for a in aliases if a in hf), aliases[0])
            for key, aliases in _MOE_ALIASES.items()
        }
        if hf.get("use_grouped_topk") is False and hf.get(names["n_group"], 1) != 1:
            refuse(
                "use_grouped_topk",
                False,
                f"with {names['n_group']} = {hf.get(names['n_group'])} (HF routes by groups "
                "regardless); use 1 group",
            )
        moe = moe_settings(config, names=names, defaults=_MOE_DEFAULTS)
    return KimiSettings(layer_types, mlp_types, kda, moe)


def _layer_types(config: ModelConfig, linear, refuse) -> tuple[str, ...]:
    """HF's precedence: `layer_types`, else linear_attn_config's 1-based layer lists, else every
    fourth layer from layer 4 (0-based) is full attention."""
    hf, n = config.hf_config, config.num_hidden_layers
    if hf.get("layer_types") is not None:
        types = tuple(hf["layer_types"])
        bad = [t for t in types if t not in (KDA, MLA)]
        if len(types) != n or bad:
            refuse("layer_types", list(types), f"expected {n} of {KDA!r} / {MLA!r}")
        return types
    if "full_attn_layers" in linear and "kda_layers" in linear:
        types: list[str | None] = [None] * n
        for key, kind in (("full_attn_layers", MLA), ("kda_layers", KDA)):
            for layer in linear[key]:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    refuse(f"linear_attn_config.{key}", list(linear[key]), f"1-based, 1..{n}")
                types[layer - 1] = kind
        if None in types:
            refuse(
                "linear_attn_config",
                {k: list(linear[k]) for k in ("kda_layers", "full_attn_layers")},
                f"layers {[i + 1 for i, t in enumerate(types) if t is None]} are in neither list",
            )
        return tuple(types)
    return tuple(MLA if i and i % 4 == 0 else KDA for i in range(n))


def _mlp_types(config: ModelConfig, refuse) -> tuple[str, ...]:
    hf, n = config.hf_config, config.num_hidden_layers
    if hf.get("mlp_layer_types") is not None:
        types = tuple(hf["mlp_layer_types"])
        if len(types) != n or any(t not in (DENSE, SPARSE) for t in types):
            refuse("mlp_layer_types", list(types), f"expected {n} of {DENSE!r} / {SPARSE!r}")
        return types
    first = hf.get("first_k_dense_replace", 1)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        refuse("first_k_dense_replace", first, "expected an int >= 0")
    return tuple(DENSE if i < first else SPARSE for i in range(n))


class KimiDecoderLayer(PreNormLayer):
    def __init__(self, cfg: ModelConfig, kind: str, attention: nnx.Module, mlp: nnx.Module):
        self.kind = kind
        super().__init__(cfg, attention, mlp)

    def __call__(self, x, entry: tuple, batch: ModelBatch, rows=None):
        if self.kind == KDA:
            return self.residual(x, lambda h: self.self_attn(h, entry, batch), rows)
        return self.residual(x, lambda h: self.self_attn(h, None, None, entry, batch), rows)


class KimiLinearForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.config = config
        k = kimi_settings(config)
        self.layer_types = k.layer_types
        self.backends = self.choose_backends(config, options)
        mla_backend, prefill, decode = self.backends
        dt = config.jnp_dtype
        layers = []
        for i, kind in enumerate(k.layer_types):
            if kind == KDA:
                attn = KimiDeltaAttention(
                    k.kda, dt, prefill=prefill, decode=decode, interpret=options.pallas_interpret
                )
            else:
                attn = MLAttention(
                    config,
                    i,
                    dt,
                    backend=mla_backend,
                    use_rope=False,
                    interpret=options.pallas_interpret,
                )
            if k.mlp_types[i] == SPARSE:
                mlp = DeepseekMoE(config, dt, k.moe)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=False, dtype=dt)
            layers.append(KimiDecoderLayer(config, kind, attn, mlp))
        self.model = DecoderStack(config, layers)
        self.lm_head = own_lm_head(config)
        # Where each layer's entry sits in the flat cache value: the MLA latent pool's layers
        # first, then the KDA state's (model/base.py: spec order).
        mla, kda = k.layers_of(MLA), k.layers_of(KDA)
        self.cache_index = tuple(
            mla.index(i) if kind == MLA else len(mla) + kda.index(i)
            for i, kind in enumerate(k.layer_types)
        )

    @classmethod
    def choose_backends(cls, config: ModelConfig, options: ModelOptions) -> tuple:
        """(MLA paged attention, kda_prefill, kda_decode) choices, made once here and logged.
        `options.attention_backend` forces all three."""
        k = kimi_settings(config)
        mla = choose_backend(
            config,
            cache_dtype=options.resolve_cache_dtype(config),
            block_size=options.block_size,
            impl=options.attention_backend,
        )
        q = jax.ShapeDtypeStruct((1, k.kda.num_heads, k.kda.head_dim), config.jnp_dtype)
        return (
            mla,
            kda_ops.select(kda_ops.PREFILL, q, q, impl=options.attention_backend),
            kda_ops.select(kda_ops.DECODE, q, q, impl=options.attention_backend),
        )

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple:
        k = kimi_settings(config)
        latent = PagedCacheSpec(
            "MLA latent",
            len(k.layers_of(MLA)),
            ("latent",),
            (options.block_size, 1, MLAShape.from_config(config).latent_dim),
            options.resolve_cache_dtype(config),
        )
        num_kda = len(k.layers_of(KDA))
        if not num_kda:
            return (latent,)
        s = k.kda
        state = StateCacheSpec(
            "KDA state",
            num_kda,
            ("recurrent", "conv"),
            ((s.num_heads, s.head_dim, s.head_dim), (s.conv_size - 1, s.conv_channels)),
            ("float32", options.resolve_cache_dtype(config)),
        )
        return (latent, state)

    # The protocol.

    def __call__(self, caches: tuple, batch: ModelBatch, rows: jax.Array | None = None):
        layers = self.model.layers
        if len(caches) != len(layers):
            raise ValueError(
                f"got {len(caches)} cache entries for {len(layers)} layers (MLA latent + KDA state)"
            )
        x = self.model.embed_tokens(batch.token_ids)
        new = list(caches)
        last = len(layers) - 1
        for i, (layer, index) in enumerate(zip(layers, self.cache_index, strict=True)):
            x, new[index] = layer(x, caches[index], batch, rows if i == last else None)
        return tuple(new), self.model.norm(x)

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array:
        return head_logits(self.model, self.lm_head, hidden_rows)

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        k = kimi_settings(c)
        h = c.hidden_size
        specs = [embedding_spec(c.vocab_size, h)]
        for i, kind in enumerate(k.layer_types):
            hf, ours = f"model.layers.{i}.", ("model", "layers", i)
            if kind == KDA:
                specs += _kda_specs(k.kda, f"{hf}self_attn.", (*ours, "self_attn"))
            else:
                specs += DeepseekV3ForCausalLM.attention_weight_specs(c, i)
            if k.mlp_types[i] == SPARSE:
                # Kimi's hub layout: block_sparse_moe.{gate, experts.N.w1/w3/w2, shared_experts}.
                specs += moe_weight_specs(
                    (*ours, "mlp"), f"{hf}block_sparse_moe", c, k.moe, ("w1", "w3", "w2")
                )
            else:
                specs += gated_mlp_specs((*ours, "mlp"), f"{hf}mlp", h, c.intermediate_size)
            specs += layer_norm_specs(i, h)
        specs += head_specs(c.vocab_size, h, c.tie_word_embeddings)
        return tuple(specs)

    @classmethod
    def hf_weight_aliases(cls, c: ModelConfig) -> dict[str, str]:
        """Dense MLP layers: `mlp.*` in hub checkpoints, `block_sparse_moe.*` as transformers 5
        saves them (its save renames every `.mlp.` back to `.block_sparse_moe.`)."""
        k = kimi_settings(c)
        return {
            f"model.layers.{i}.mlp.{n}.weight": f"model.layers.{i}.block_sparse_moe.{n}.weight"
            for i, kind in enumerate(k.mlp_types)
            if kind == DENSE
            for n in ("gate_proj", "up_proj", "down_proj")
        }

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        """A duplicate tied head, and multi-token-prediction layers stored after the last decoder
        layer (model.layers.{num_hidden_layers}...), which plain decoding does not run."""
        if c.tie_word_embeddings and name == "lm_head.weight":
            return True
        return past_last_layer(name, c.num_hidden_layers)


def _linear(path: tuple, name: str, out_features: int, in_features: int) -> WeightSpec:
    return WeightSpec((*path, "weight"), ((f"{name}.weight", (out_features, in_features)),))


def _kda_specs(s: KDAShape, hf: str, ours: tuple) -> list[WeightSpec]:
    d, h, k, w = s.hidden_size, s.num_heads, s.head_dim, s.conv_size
    # The order of KimiDeltaAttention.in_proj's outputs.
    inputs = (
        ("q_proj", h * k), ("k_proj", h * k), ("v_proj", h * k),
        ("f_a_proj", k), ("g_a_proj", k), ("b_proj", h),
    )  # fmt: skip
    return [
        WeightSpec(
            (*ours, "in_proj", "weight"),
            tuple((f"{hf}{n}.weight", (rows, d)) for n, rows in inputs),
        ),
        WeightSpec(
            (*ours, "conv_weight"),
            tuple((f"{hf}{p}_conv1d.weight", (h * k, 1, w)) for p in "qkv"),
            True,
        ),
        _linear((*ours, "f_b_proj"), f"{hf}f_b_proj", h * k, k),
        WeightSpec((*ours, "A_log"), ((f"{hf}A_log", (1, 1, h, 1)),)),
        WeightSpec((*ours, "dt_bias"), ((f"{hf}dt_bias", (h * k,)),)),
        _linear((*ours, "g_b_proj"), f"{hf}g_b_proj", h * k, k),
        WeightSpec((*ours, "o_norm"), ((f"{hf}o_norm.weight", (k,)),)),
        _linear((*ours, "o_proj"), f"{hf}o_proj", d, h * k),
    ]
