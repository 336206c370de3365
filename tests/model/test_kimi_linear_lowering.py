"""Kimi-Linear's whole jitted step, with its kernels forced to Pallas, lowered for cuda and rocm from
this CPU host: every KDA prefill/decode call and the MLA paged attention reach Triton. Nothing runs
(abstract weights, caches and batch), so the step is checked at KDA's production head sizes too.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.batch import ModelBatch
from model.config import from_hf_dict
from model.kimi_linear import KimiLinearForCausalLM

SDS = jax.ShapeDtypeStruct
TRITON = "__gpu$xla.gpu.triton"


def _config(**fields):
    hf = dict(
        architectures=["KimiLinearForCausalLM"],
        model_type="kimi_linear",
        dtype="bfloat16",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
    )
    return from_hf_dict({**hf, **fields}, path="lowering")


def _lowered_step(config, platform, tokens=48, seqs=4, blocks=8, slots=6) -> str:
    options = ModelOptions(block_size=16, attention_backend="pallas", pallas_interpret=False)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: KimiLinearForCausalLM(config, options)))
    specs = KimiLinearForCausalLM.cache_specs(config, options)
    caches = jax.eval_shape(lambda: base.allocate(specs, 32, slots))
    i32 = jnp.int32
    batch = ModelBatch(
        token_ids=SDS((tokens,), i32),
        positions=SDS((tokens,), i32),
        slot_mapping=SDS((tokens,), i32),
        block_tables=SDS((seqs, blocks), i32),
        kv_lens=SDS((seqs,), i32),
        cu_q_lens=SDS((seqs + 1,), i32),
        num_seqs=SDS((), i32),
        logits_indices=SDS((seqs,), i32),
        state_slots=SDS((seqs,), i32),
        state_reset=SDS((seqs,), jnp.bool_),
    )
    step = jax.jit(base.forward, donate_argnums=2)
    traced = step.trace(graphdef, state, caches, batch)
    return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_whole_step_with_pallas_kernels_lowers_to_triton(platform):
    tiny = _config()
    # KDA at Kimi-Linear-48B's head sizes (32 heads of 128); MLA latent 64 + 64.
    production_heads = _config(
        hidden_size=256,
        linear_num_heads=32,
        linear_head_dim=128,
        kv_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
    )
    for config in (tiny, production_heads):
        text = _lowered_step(config, platform)
        # Each kernel is one Triton call (the layers that share it call one function); none is
        # left in interpret mode, which would lower to plain HLO with no Triton call.
        triton = {
            name
            for line in text.splitlines()
            if TRITON in line
            for name in re.findall(r'name = "([a-z_]+)"', line)
        }
        assert triton == {"kda_prefill", "kda_decode", "ragged_paged_attention"}, (
            platform,
            config.hidden_size,
            triton,
        )
