"""The SigLIP vision tower (HF's SiglipVisionModel without its pooling head): the image encoder of
PaliGemma and ColPali.

Patches of patch_size x patch_size pixels are embedded by a strided convolution (a matmul over each
patch, weights kept in HF's [out, channels, p, p] layout), learned position embeddings added, then
pre-LayerNorm encoder layers with bidirectional attention over the image's patches (the dense
attention op, pallas_kernels.flash_attention, chosen once at build time) and a tanh-GELU MLP, and a
final LayerNorm. Images come at the checkpoint's image_size; resizing is the input processor's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ConfigError
from model.layers.linear import Linear
from model.layers.mlp import ACTIVATIONS
from model.layers.norms import LayerNorm
from model.weight_spec import WeightSpec
from pallas_kernels.backends import Choice
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention import select as select_dense


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, hf, path: str = "") -> VisionConfig:
        """From a checkpoint's vision_config (HF SiglipVisionConfig defaults where a key is absent)."""
        get = hf.get
        cfg = cls(
            hidden_size=get("hidden_size", 768),
            intermediate_size=get("intermediate_size", 3072),
            num_hidden_layers=get("num_hidden_layers", 12),
            num_attention_heads=get("num_attention_heads", 12),
            image_size=get("image_size", 224),
            patch_size=get("patch_size", 16),
            num_channels=get("num_channels", 3),
            layer_norm_eps=float(get("layer_norm_eps", 1e-6)),
            hidden_act=get("hidden_act", "gelu_pytorch_tanh"),
        )
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "image_size", "patch_size", "num_channels"):  # fmt: skip
            v = getattr(cfg, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{path}: vision_config.{key} must be a positive int, got {v!r}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(
                f"{path}: vision_config.hidden_size {cfg.hidden_size} is not divisible by "
                f"num_attention_heads {cfg.num_attention_heads}"
            )
        if cfg.image_size % cfg.patch_size:
            raise ConfigError(
                f"{path}: vision_config.image_size {cfg.image_size} is not a multiple of "
                f"patch_size {cfg.patch_size}"
            )
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ConfigError(
                f"{path}: vision_config.hidden_act {cfg.hidden_act!r} is not served "
                "(SigLIP uses 'gelu_pytorch_tanh')"
            )
        if get("vision_use_head", False):
            raise ConfigError(
                f"{path}: vision_config.vision_use_head is true: the attention-pooling head is "
                "not served (PaliGemma and ColPali read the patch states)"
            )
        return cfg


def choose_backend(cfg: VisionConfig, dtype, impl: str) -> Choice:
    """The dense-attention implementation for the tower's layers (one decision, logged)."""
    q = jax.ShapeDtypeStruct((1, cfg.num_patches, cfg.num_attention_heads, cfg.head_dim), dtype)
    return select_dense(q, q, causal=False, impl=impl)


class SiglipEncoderLayer(nnx.Module):
    def __init__(self, cfg: VisionConfig, backend: Choice, dtype):
        h = cfg.hidden_size
        self.layer_norm1 = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.qkv_proj = Linear(h, 3 * h, bias=True, dtype=dtype)  # HF's q_proj, k_proj, v_proj
        self.out_proj = Linear(h, h, bias=True, dtype=dtype)
        self.layer_norm2 = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.fc1 = Linear(h, cfg.intermediate_size, bias=True, dtype=dtype)
        self.fc2 = Linear(cfg.intermediate_size, h, bias=True, dtype=dtype)
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.act = cfg.hidden_act
        self.backend = backend

    def __call__(self, x: jax.Array) -> jax.Array:
        n, p, h = x.shape
        q, k, v = jnp.split(
            self.qkv_proj(self.layer_norm1(x)).reshape(n, p, 3, self.num_heads, self.head_dim),
            3,
            axis=2,
        )
        out = flash_attention(
            q[:, :, 0],
            k[:, :, 0],
            v[:, :, 0],
            causal=False,
            sm_scale=self.head_dim**-0.5,
            impl=self.backend,
        )
        x = x + self.out_proj(out.reshape(n, p, h))
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.layer_norm2(x))))


class SiglipVisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, backend: Choice, dtype):
        c, p, h = cfg.num_channels, cfg.patch_size, cfg.hidden_size
        self.patch_embedding = nnx.Param(jnp.zeros((h, c, p, p), dtype))  # HF's conv layout
        self.patch_bias = nnx.Param(jnp.zeros((h,), dtype))
        self.position_embedding = nnx.Param(jnp.zeros((cfg.num_patches, h), dtype))
        self.layers = nnx.List(
            [SiglipEncoderLayer(cfg, backend, dtype) for _ in range(cfg.num_hidden_layers)]
        )
        self.post_layernorm = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.cfg = cfg

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [N, C, S, S] (S = image_size) -> patch states [N, num_patches, hidden]."""
        cfg = self.cfg
        n, c, hgt, wid = pixel_values.shape
        s, p = cfg.image_size, cfg.patch_size
        if (c, hgt, wid) != (cfg.num_channels, s, s):
            raise ValueError(
                f"pixel_values must be [N, {cfg.num_channels}, {s}, {s}] (the checkpoint's "
                f"image_size), got {pixel_values.shape}"
            )
        w = self.patch_embedding[...]
        g = s // p
        patches = pixel_values.astype(w.dtype).reshape(n, c, g, p, g, p)
        # The convolution, row-major over the patch grid as HF flattens it; f32 accumulation.
        x = jnp.einsum("ncyiwj,ocij->nywo", patches, w, preferred_element_type=jnp.float32)
        x = (x + self.patch_bias[...].astype(jnp.float32)).astype(w.dtype).reshape(n, g * g, -1)
        x = x + self.position_embedding[...][None]
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


def siglip_specs(cfg: VisionConfig, hf: str, ours: tuple) -> list[WeightSpec]:
    """The tower's weights from HF names under prefix `hf` (e.g. "vision_tower."), at `ours`."""
    h, inter, c, p = cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size
    emb = hf + "embeddings."
    specs = [
        WeightSpec((*ours, "patch_embedding"), ((emb + "patch_embedding.weight", (h, c, p, p)),)),
        WeightSpec((*ours, "patch_bias"), ((emb + "patch_embedding.bias", (h,)),)),
        WeightSpec(
            (*ours, "position_embedding"),
            ((emb + "position_embedding.weight", (cfg.num_patches, h)),),
        ),
        WeightSpec((*ours, "post_layernorm", "weight"), ((hf + "post_layernorm.weight", (h,)),)),
        WeightSpec((*ours, "post_layernorm", "bias"), ((hf + "post_layernorm.bias", (h,)),)),
    ]
    for i in range(cfg.num_hidden_layers):
        layer, at = f"{hf}encoder.layers.{i}.", (*ours, "layers", i)
        attn = layer + "self_attn."
        qkv = ("q", "k", "v")
        specs += [
            WeightSpec(
                (*at, "qkv_proj", "weight"),
                tuple((f"{attn}{n}_proj.weight", (h, h)) for n in qkv),
            ),
            WeightSpec(
                (*at, "qkv_proj", "bias"), tuple((f"{attn}{n}_proj.bias", (h,)) for n in qkv)
            ),
            WeightSpec((*at, "out_proj", "weight"), ((attn + "out_proj.weight", (h, h)),)),
            WeightSpec((*at, "out_proj", "bias"), ((attn + "out_proj.bias", (h,)),)),
            WeightSpec((*at, "fc1", "weight"), ((layer + "mlp.fc1.weight", (inter, h)),)),
            WeightSpec((*at, "fc1", "bias"), ((layer + "mlp.fc1.bias", (inter,)),)),
            WeightSpec((*at, "fc2", "weight"), ((layer + "mlp.fc2.weight", (h, inter)),)),
            WeightSpec((*at, "fc2", "bias"), ((layer + "mlp.fc2.bias", (h,)),)),
        ]
        for n in ("layer_norm1", "layer_norm2"):
            specs += [
                WeightSpec((*at, n, part), ((f"{layer}{n}.{part}", (h,)),))
                for part in ("weight", "bias")
            ]
    return specs
