"""Model mutants: the Llama block and its layers (norms, rotary, attention, MLP, linear)."""

from benchmarks.mutants.mutant import Mutant

MODEL = ("tests/model",)

LLAMA = "model/llama.py"
DECODER = "model/layers/decoder.py"
NORM = "model/layers/norms.py"
ROPE = "model/layers/rotary.py"
ATTN = "model/layers/attention.py"
MLP = "model/layers/mlp.py"
LIN = "model/layers/linear.py"

MUTANTS: tuple[Mutant, ...] = (
    # ---- model
    Mutant(
        "model_attention_reads_post_attention_norm",
        DECODER,
        "h, entry = attend(self.input_layernorm(x))",
        "h, entry = attend(self.post_attention_layernorm(x))",
        MODEL,
    ),
    Mutant(
        "model_final_norm_skipped",
        LLAMA,
        "return tuple(new_caches), self.model.norm(x)",
        "return tuple(new_caches), x",
        MODEL,
    ),
    Mutant(
        "model_k_and_v_swapped_at_load",
        LLAMA,
        'qkv = (("q", nq), ("k", nkv), ("v", nkv))',
        'qkv = (("q", nq), ("v", nkv), ("k", nkv))',
        MODEL,
    ),
    Mutant(
        "model_rms_norm_without_eps",
        NORM,
        "return weight * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)",
        "return weight * (xf * jax.lax.rsqrt(var)).astype(x.dtype)",
        MODEL,
    ),
    Mutant(
        "model_rms_norm_scales_before_rounding",
        NORM,
        "return weight * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)",
        "return (weight.astype(jnp.float32) * xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)",
        MODEL,
    ),
    Mutant(
        "model_rotary_turns_backwards",
        ROPE,
        "return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)",
        "return jnp.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)",
        MODEL,
    ),
    Mutant(
        "model_llama3_rope_blend_swapped",
        ROPE,
        "smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled",
        "smoothed = (1 - smooth) * scaled + smooth * scaled / rope.factor",
        MODEL,
    ),
    Mutant(
        "model_linear_rope_multiplies",
        ROPE,
        "return (inv / np.float32(rope.factor)).astype(np.float32), 1.0",
        "return (inv * np.float32(rope.factor)).astype(np.float32), 1.0",
        MODEL,
    ),
    Mutant(
        "model_yarn_attention_factor_dropped",
        ROPE,
        "return inv.astype(np.float32), float(scale)",
        "return inv.astype(np.float32), 1.0",
        MODEL,
    ),
    Mutant(
        "model_softmax_scale_of_all_heads",
        ATTN,
        "_attend, sm_scale=d**-0.5, sliding_window=self.sliding_window, impl=self.backend",
        "_attend, sm_scale=(hq * d) ** -0.5, sliding_window=self.sliding_window, impl=self.backend",
        MODEL,
    ),
    Mutant(
        "model_k_normed_by_q_norm",
        ATTN,
        "q, k = self.q_norm(q), self.k_norm(k)",
        "q, k = self.q_norm(q), self.q_norm(k)",
        MODEL,
    ),
    Mutant(
        "model_gate_and_up_swapped",
        MLP,
        "gate, up = split_fused(self.gate_up_proj(x), (n, n), group_size())",
        "up, gate = split_fused(self.gate_up_proj(x), (n, n), group_size())",
        MODEL,
    ),
    Mutant(
        "model_linear_bias_dropped",
        LIN,
        "y = y + self.bias[...].astype(jnp.float32)",
        "y = y",
        MODEL,
    ),
)
