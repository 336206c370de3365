"""Writing this step's keys and values into the paged KV cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.bitcast import from_bits, to_bits


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter k, v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at the given slots.

    slot = block * block_size + offset; slot -1 (padding tokens) is skipped. The caches are donated,
    so the update happens in place when called at top level (inside an outer jit the caller's
    donation governs).
    """
    nb, bs, hkv, d = k_cache.shape
    if k.shape[1:] != (hkv, d) or v.shape != k.shape or slot_mapping.shape != k.shape[:1]:
        raise ValueError(
            f"write_kv: k {k.shape}, v {v.shape}, slot_mapping {slot_mapping.shape} do not match "
            f"cache [num_blocks, block_size, Hkv={hkv}, D={d}] (expected k, v [T, {hkv}, {d}], "
            "slot_mapping [T])"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"write_kv: v_cache {v_cache.shape} != k_cache {k_cache.shape}")
    n = nb * bs
    # A negative index would wrap to the last slot; send skipped tokens past the end to be dropped.
    slots = jnp.where(slot_mapping < 0, n, slot_mapping).astype(jnp.int32)

    def put(cache, x):
        flat = to_bits(cache).reshape(n, hkv, d)
        flat = flat.at[slots].set(to_bits(x.astype(cache.dtype)), mode="drop")
        return from_bits(flat.reshape(cache.shape), cache.dtype)

    return put(k_cache, k), put(v_cache, v)
