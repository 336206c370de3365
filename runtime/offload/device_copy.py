"""Copies of whole KV blocks between the device KV cache and host bytes.

The KV cache is the model's flat cache value (model/base.py): one entry per layer of each cache
spec, in spec order, each a tuple of that layer's arrays [num_blocks, *page_shape]. Pools differ in
page shape and dtype (K/V [bs, Hkv, D], an MLA latent [bs, 1, 576], indexer keys [bs, 1, 128]); all
share the block axis. A block's bytes are its slice of every array of every pool, in that order,
concatenated: one row of `block_nbytes(kv_cache)` uint8 per block (the sum of the specs'
`bytes_per_block`), so a stored or loaded block moves every pool at once.

Block-id batches are padded to a power of two (by repeating the last id, which rewrites the same
value) so the number of compilations stays small.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["block_nbytes", "gather_blocks", "rows_to_host", "scatter_blocks"]


def _leaves(kv_cache) -> list[jax.Array]:
    return [array for layer in kv_cache for array in layer]


def block_nbytes(kv_cache) -> int:
    return sum(a.dtype.itemsize * (a.size // a.shape[0]) for a in _leaves(kv_cache))


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _padded_ids(block_ids) -> jax.Array:
    ids = list(block_ids)
    if not ids:
        raise ValueError("no block ids given; a KV job covers at least one block")
    return jnp.asarray(ids + [ids[-1]] * (_bucket(len(ids)) - len(ids)), dtype=jnp.int32)


def _as_bytes(x: jax.Array) -> jax.Array:
    rows = x.reshape(x.shape[0], -1)
    if rows.dtype == jnp.uint8:
        return rows
    return jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(rows.shape[0], -1)


def _from_bytes(rows: jax.Array, like: jax.Array) -> jax.Array:
    n, itemsize = rows.shape[0], like.dtype.itemsize
    if itemsize > 1:
        rows = rows.reshape(n, -1, itemsize)
    return jax.lax.bitcast_convert_type(rows, like.dtype).reshape((n,) + like.shape[1:])


@jax.jit
def _gather(kv_cache, ids):
    return jnp.concatenate([_as_bytes(a[ids]) for a in _leaves(kv_cache)], axis=1)


def gather_blocks(kv_cache, block_ids) -> tuple[jax.Array, int]:
    """Dispatch the gather of the blocks' rows (asynchronous); returns (padded rows, n).

    The result is a new array, so the caller may donate `kv_cache` to the next step at once.
    """
    return _gather(kv_cache, _padded_ids(block_ids)), len(block_ids)


def rows_to_host(rows: jax.Array, n: int) -> np.ndarray:
    """Wait for a gather and copy its first n rows to host memory: [n, block_nbytes] uint8."""
    return np.asarray(rows)[:n]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(kv_cache, ids, rows):
    out, offset, finite = [], 0, jnp.bool_(True)
    for layer in kv_cache:
        new_layer = []
        for array in layer:
            width = array.dtype.itemsize * (array.size // array.shape[0])
            blocks = _from_bytes(rows[:, offset : offset + width], array)
            offset += width
            if jnp.issubdtype(array.dtype, jnp.floating):
                finite &= jnp.isfinite(blocks).all()
            new_layer.append(array.at[ids].set(blocks))
        out.append(tuple(new_layer))
    return tuple(out), finite


def scatter_blocks(kv_cache, block_ids, rows: np.ndarray):
    """Write host rows into the blocks (donating `kv_cache`); returns (kv_cache, all finite).

    Store bytes are not trusted: a row holding NaN or inf is reported so the caller can fail the
    load (and recompute those tokens over the written blocks) instead of attending to it.
    """
    nbytes = block_nbytes(kv_cache)
    rows = np.asarray(rows, dtype=np.uint8)
    if rows.shape != (len(block_ids), nbytes):
        raise ValueError(
            f"scatter_blocks: rows of shape {rows.shape}, expected ({len(block_ids)}, {nbytes})"
        )
    pad = _bucket(len(block_ids)) - len(block_ids)
    if pad:
        rows = np.concatenate([rows, np.repeat(rows[-1:], pad, axis=0)])
    kv_cache, finite = _scatter(kv_cache, _padded_ids(block_ids), rows)
    return kv_cache, bool(finite)
