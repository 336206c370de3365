"""Kernel mutants: the jnp references the Pallas kernels are tested against."""

from benchmarks.mutants.mutant import Mutant

RPA = (
    "tests/pallas_kernels/test_ragged_paged_attention_reference.py",
    "tests/pallas_kernels/test_ragged_paged_attention.py",
)
FLASH = ("tests/pallas_kernels/test_flash_attention.py",)
KDA = ("tests/pallas_kernels/test_kda_reference.py", "tests/pallas_kernels/test_kda_decode.py")
MLA = ("tests/pallas_kernels/test_sparse_mla_decode.py",)

RPA_REF = "pallas_kernels/ragged_paged_attention/reference.py"
FLASH_REF = "pallas_kernels/flash_attention/reference.py"
KDA_REF = "pallas_kernels/kda/reference.py"
MLA_REF = "pallas_kernels/sparse_mla_decode/reference.py"

MUTANTS: tuple[Mutant, ...] = (
    # ---- kernel references
    Mutant(
        "rpa_query_cannot_see_itself",
        RPA_REF,
        "mask = key_ok[:, None, :] & (k_pos[None, None, :] <= horizon[:, :, None])",
        "mask = key_ok[:, None, :] & (k_pos[None, None, :] < horizon[:, :, None])",
        RPA,
    ),
    Mutant(
        "rpa_sliding_window_off_by_one",
        RPA_REF,
        "mask &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window",
        "mask &= q_pos[:, :, None] - k_pos[None, None, :] <= sliding_window",
        RPA,
    ),
    Mutant(
        "rpa_non_finite_values_not_kept_out",
        RPA_REF,
        "vw = jnp.where(v_bad[..., None], 0.0, vw)",
        "vw = vw",
        RPA,
    ),
    Mutant(
        "rpa_soft_cap_unscaled",
        RPA_REF,
        "s = soft_cap * jnp.tanh(s / soft_cap)",
        "s = jnp.tanh(s / soft_cap)",
        RPA,
    ),
    Mutant(
        "flash_causal_mask_transposed",
        FLASH_REF,
        "mask = mask & jnp.tril(jnp.ones((s, s), bool))[None]",
        "mask = mask & jnp.triu(jnp.ones((s, s), bool))[None]",
        FLASH,
    ),
    Mutant(
        "flash_segments_see_earlier_segments",
        FLASH_REF,
        "mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])",
        "mask = mask & (segment_ids[:, :, None] >= segment_ids[:, None, :])",
        FLASH,
    ),
    Mutant(
        "kda_beta_dropped_from_update",
        KDA_REF,
        "s = s + beta[:, None, None] * u[:, :, None] * k[:, None, :]",
        "s = s + u[:, :, None] * k[:, None, :]",
        KDA,
    ),
    Mutant(
        "kda_value_heads_read_tiled_qk_heads",
        KDA_REF,
        "return jnp.repeat(q * scale, rep, axis=1), jnp.repeat(k, rep, axis=1)",
        "return jnp.tile(q * scale, (1, rep, 1)), jnp.tile(k, (1, rep, 1))",
        KDA,
    ),
    Mutant(
        "kda_decode_slot_zero_is_padding",
        KDA_REF,
        "live = state_indices[r] >= 0",
        "live = state_indices[r] > 0",
        KDA,
    ),
    Mutant(
        "mla_sink_not_shifted_by_max",
        MLA_REF,
        "denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :] - m_safe)",
        "denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :])",
        MLA,
    ),
    Mutant(
        "mla_topk_length_inclusive",
        MLA_REF,
        "ok &= pos < topk_lengths[:, None]",
        "ok &= pos <= topk_lengths[:, None]",
        MLA,
    ),
    Mutant(
        "mla_value_is_the_latent_tail",
        MLA_REF,
        'acc = jnp.einsum("thk,tkd->thd", p, rows[..., :d_v], precision=hi)',
        'acc = jnp.einsum("thk,tkd->thd", p, rows[..., -d_v:], precision=hi)',
        MLA,
    ),
)
