"""Writing this step's keys and values into the paged KV cache."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.paged_write import write_rows
from pallas_kernels.ragged_paged_attention import native


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter k, v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at the given slots.

    slot = block * block_size + offset; slot -1 (padding tokens) is skipped. The caches are donated,
    so the update happens in place when called at top level (inside an outer jit the caller's
    donation governs).
    """
    _, _, hkv, d = k_cache.shape
    if k.shape[1:] != (hkv, d) or v.shape != k.shape or slot_mapping.shape != k.shape[:1]:
        raise ValueError(
            f"write_kv: k {k.shape}, v {v.shape}, slot_mapping {slot_mapping.shape} do not match "
            f"cache [num_blocks, block_size, Hkv={hkv}, D={d}] (expected k, v [T, {hkv}, {d}], "
            "slot_mapping [T])"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"write_kv: v_cache {v_cache.shape} != k_cache {k_cache.shape}")
    if native.serves_write(k_cache):  # in place on the CPU, whatever XLA does with bf16 scatters
        return native.write(k_cache, k, slot_mapping), native.write(v_cache, v, slot_mapping)
    return write_rows(k_cache, k, slot_mapping), write_rows(v_cache, v, slot_mapping)
