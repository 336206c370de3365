"""How one model parameter is assembled from tensors stored on disk under their HF names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightSpec:
    path: tuple  # the parameter's path in the model's nnx state
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF tensor name, expected shape on disk)
    # Several sources are joined along the output axis (fused q/k/v and gate/up projections):
    # axis 0 of HF's [out, in] linear weights, which Linear keeps as they are. `transpose`: the
    # parameter is laid out transposed (the MoE router's and routed experts' [in, out] kernels,
    # KDA's conv taps), each source transposed and joined along the last axis.
    transpose: bool = False
    # When > 0, the sources are this many equal consecutive runs, each joined as above into one
    # entry of a new leading axis: MoE experts, stored one tensor per expert on disk, kept stacked.
    stacked: int = 0

    def __post_init__(self):
        if self.stacked < 0 or (self.stacked and len(self.sources) % self.stacked):
            raise ValueError(
                f"WeightSpec {self.path}: {len(self.sources)} sources cannot be stacked "
                f"{self.stacked} ways"
            )


# The pieces every HF decoder-only checkpoint names the same way (Llama, Qwen, DeepSeek, Kimi).


def embedding_spec(vocab_size: int, hidden: int) -> WeightSpec:
    return WeightSpec(
        ("model", "embed_tokens", "weight"), (("model.embed_tokens.weight", (vocab_size, hidden)),)
    )


def layer_norm_specs(layer_idx: int, hidden: int) -> list[WeightSpec]:
    """A decoder layer's two norms: before attention and before the MLP."""
    hf, ours = f"model.layers.{layer_idx}.", ("model", "layers", layer_idx)
    return [
        WeightSpec((*ours, n, "weight"), ((f"{hf}{n}.weight", (hidden,)),))
        for n in ("input_layernorm", "post_attention_layernorm")
    ]


def head_specs(vocab_size: int, hidden: int, tied: bool) -> list[WeightSpec]:
    """The final norm, and the LM head unless it is tied to the embeddings."""
    specs = [WeightSpec(("model", "norm", "weight"), (("model.norm.weight", (hidden,)),))]
    if not tied:
        specs.append(WeightSpec(("lm_head", "weight"), (("lm_head.weight", (vocab_size, hidden)),)))
    return specs


def gated_mlp_specs(
    module_path: tuple, hf_prefix: str, hidden: int, inter: int
) -> list[WeightSpec]:
    """A GatedMLP without biases from HF's gate_proj, up_proj and down_proj under `hf_prefix`
    (e.g. "model.layers.0.mlp"); gate and up fused as the module keeps them."""
    return [
        WeightSpec(
            (*module_path, "gate_up_proj", "weight"),
            (
                (f"{hf_prefix}.gate_proj.weight", (inter, hidden)),
                (f"{hf_prefix}.up_proj.weight", (inter, hidden)),
            ),
        ),
        WeightSpec(
            (*module_path, "down_proj", "weight"),
            ((f"{hf_prefix}.down_proj.weight", (hidden, inter)),),
        ),
    ]


def past_last_layer(name: str, num_hidden_layers: int) -> bool:
    """A tensor of a layer after the last decoder layer (model.layers.{num_hidden_layers}...):
    the multi-token-prediction layers DeepSeek and Kimi checkpoints store, which plain decoding
    does not run."""
    parts = name.split(".")
    return (
        len(parts) > 2
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and int(parts[2]) >= num_hidden_layers
    )
