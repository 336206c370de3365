"""model/layers/pooler.py: pooling over a ragged batch against a per-sequence numpy computation,
with padding tokens and padding sequences, under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers.pooler import normalize, pool

# (sequence lengths, padded tokens, padded sequences)
LAYOUTS = [([1], 1, 1), ([3, 1, 5], 16, 8), ([7], 8, 4), ([2, 9, 4, 1, 6], 32, 5)]


def expected(hidden, lengths, num_seqs, pooling_type):
    out, start = np.zeros((num_seqs, hidden.shape[1]), np.float32), 0
    for s, n in enumerate(lengths):
        rows = hidden[start : start + n]
        out[s] = {"MEAN": rows.mean(0), "CLS": rows[0], "LAST": rows[-1]}[pooling_type]
        start += n
    return out


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_pool_matches_per_sequence_numpy(pooling_type):
    fn = jax.jit(pool, static_argnums=3)
    rng = np.random.default_rng(0)
    for lengths, num_tokens, num_seqs in LAYOUTS:
        # Padding tokens hold large values: a pooling that reads them is far off.
        hidden = np.full((num_tokens, 6), 1e4, np.float32)
        used = sum(lengths)
        hidden[:used] = rng.standard_normal((used, 6))
        cu = np.full(num_seqs + 1, used, np.int32)
        cu[: len(lengths) + 1] = np.concatenate([[0], np.cumsum(lengths)])
        got = fn(jnp.asarray(hidden), jnp.asarray(cu), jnp.asarray(len(lengths)), pooling_type)
        np.testing.assert_allclose(
            np.asarray(got), expected(hidden, lengths, num_seqs, pooling_type), atol=1e-6
        )


def test_normalize_is_torch_normalize():
    import torch

    x = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
    x[2] = 0.0  # a zero row stays zero (the norm is floored at 1e-12)
    ours = np.asarray(normalize(jnp.asarray(x)))
    theirs = torch.nn.functional.normalize(torch.from_numpy(x), p=2, dim=-1).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-7)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        pool(jnp.zeros((2, 3)), jnp.array([0, 2]), jnp.array(1), "MAX")
