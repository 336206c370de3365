"""write_rows (and write_kv, MLA's write_latent through it): rows land at their slots, slot -1 writes
nothing, under jit with the pool donated; and the write is in place, not a copy of the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers.mla import write_latent
from pallas_kernels.paged_write import write_rows
from pallas_kernels.ragged_paged_attention import write_kv

NB, BS, D = 5, 4, 3
# -1 is padding: a negative block index would wrap to the last block (slot 19's block).
SLOTS = np.array([-1, 6, 19, -1, 0, 13], np.int32)


def expected(pool, rows, slots):
    want = np.array(pool, np.float32).reshape(NB * BS, *pool.shape[2:])
    for row, slot in zip(rows, slots, strict=True):
        if slot >= 0:
            want[slot] = row
    return want.reshape(pool.shape)


def test_rows_land_at_their_slots_and_padding_writes_nothing():
    for dtype in (jnp.float32, jnp.bfloat16):
        for heads in (1, 2):
            shape = (NB, BS, heads, D)
            pool = np.full(shape, 7.0, np.float32)
            rows = np.arange(len(SLOTS) * heads * D, dtype=np.float32).reshape(-1, heads, D) + 1
            want = expected(pool, rows, SLOTS)
            msg = f"{jnp.dtype(dtype).name}, {heads} heads"

            write = jax.jit(write_rows, donate_argnums=0)
            got = write(jnp.asarray(pool, dtype), jnp.asarray(rows, dtype), jnp.asarray(SLOTS))
            assert got.dtype == dtype, msg
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want, err_msg=msg)

            k_cache, v_cache = write_kv(
                jnp.asarray(pool, dtype),
                jnp.asarray(pool + 1, dtype),
                jnp.asarray(rows, dtype),
                jnp.asarray(-rows, dtype),
                jnp.asarray(SLOTS),
            )
            np.testing.assert_array_equal(np.asarray(k_cache.astype(jnp.float32)), want, msg)
            want_v = expected(pool + 1, -rows, SLOTS)
            np.testing.assert_array_equal(np.asarray(v_cache.astype(jnp.float32)), want_v, msg)

        # MLA's latent pool has one head; write_latent takes rows [T, D].
        pool = np.full((NB, BS, 1, D), 7.0, np.float32)
        rows = np.arange(len(SLOTS) * D, dtype=np.float32).reshape(-1, D) + 1
        latent = jax.jit(write_latent, donate_argnums=0)
        got = latent(jnp.asarray(pool, dtype), jnp.asarray(rows, dtype), jnp.asarray(SLOTS))
        want = expected(pool, rows[:, None, :], SLOTS)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want, str(dtype))


def test_the_donated_write_needs_no_copy_of_the_pool():
    """The scenario that used to break: with one head (MLA's latent, an MQA pool), scattering into a
    flat [blocks * block_size, D] reshape of the pool made XLA:CPU build the result in a pool-sized
    scratch buffer and copy it back, every call, even donated. In place, the only scratch is the
    indices. (f32: XLA:CPU moves a bf16 pool through a uint16 view, a pass of its own.)"""
    for heads in (1, 2):
        pool = jax.ShapeDtypeStruct((256, 16, heads, 64), jnp.float32)
        rows = jax.ShapeDtypeStruct((8, heads, 64), jnp.float32)
        slots = jax.ShapeDtypeStruct((8,), jnp.int32)
        pool_bytes = 256 * 16 * heads * 64 * 4
        compiled = [
            jax.jit(write_rows, donate_argnums=0).lower(pool, rows, slots).compile(),
            write_kv.lower(pool, pool, rows, rows, slots).compile(),
        ]
        if heads == 1:
            latent = jax.ShapeDtypeStruct((8, 64), jnp.float32)
            write = jax.jit(write_latent, donate_argnums=0)
            compiled.append(write.lower(pool, latent, slots).compile())
        for c in compiled:
            memory = c.memory_analysis()
            assert memory.alias_size_in_bytes >= pool_bytes, (heads, memory)
            assert memory.temp_size_in_bytes < pool_bytes // 16, (heads, memory)


def test_shape_errors_name_the_shapes():
    pool = jnp.zeros((NB, BS, 2, D))
    with pytest.raises(ValueError, match=r"expected rows \[T, 2, 3\] and slot_mapping \[T\]"):
        write_rows(pool, jnp.zeros((4, 1, D)), jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"got \(5, 4, 2, 3\)"):
        write_rows(pool, jnp.zeros((4, 2, D)), jnp.zeros((3,), jnp.int32))
