"""Rotary position embeddings (NeoX half-split layout) for the rope types Llama-family HF
checkpoints use, with inverse frequencies computed exactly as transformers does (f32)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import RopeConfig


def _pos_freqs(theta: float, dim: int) -> np.ndarray:
    """theta ** (2i / dim) rounded once to f32: torch's f32 pow is (nearly always) correctly
    rounded and numpy's is not, and at long contexts a 1-ulp frequency error is a visible angle."""
    exps = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    return (np.float64(theta) ** exps).astype(np.float32)


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    return np.float32(1.0) / _pos_freqs(theta, dim)


def _llama3(rope: RopeConfig, inv: np.ndarray) -> np.ndarray:
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: RopeConfig) -> tuple[np.ndarray, float]:
    dim, base, factor = rope.head_dim, rope.theta, rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scale = rope.attention_factor
    if scale is None:
        if rope.mscale and rope.mscale_all_dim:
            scale = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            scale = mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = _pos_freqs(base, dim)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv.astype(np.float32), float(scale)


@functools.lru_cache(maxsize=64)
def inv_freq_and_scale(rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim / 2] and the factor cos and sin are multiplied by."""
    inv = _default_inv_freq(rope.theta, rope.head_dim)
    if rope.rope_type == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope)
    # "dynamic" NTK equals the default frequencies up to max_position_embeddings, which bounds
    # the context (max_model_len); beyond it transformers rescales per call, which a paged cache
    # holding keys rotated by earlier calls cannot reproduce.
    return inv, 1.0


def rotary_cos_sin(positions: jax.Array, rope: RopeConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, head_dim / 2] for the given absolute positions, rounded to `dtype`."""
    inv, scale = inv_freq_and_scale(rope)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
    cos, sin = (jnp.cos(freqs) * scale).astype(dtype), (jnp.sin(freqs) * scale).astype(dtype)
    return _computed_once(cos), _computed_once(sin)


def _computed_once(x: jax.Array) -> jax.Array:
    """`x` itself (x + 0), as a reduction: XLA:CPU computes a reduction into a buffer of its own,
    where it fuses a plain elementwise cos or sin into every layer's rotation and evaluates it
    again for each element of each head (`optimization_barrier` does not stop that on the CPU).
    Measured: eight layers' rotations and projections of a 2048-token step at the benchmark
    Llama's shapes, 137-140 ms with one cos per layer, 115 ms with one per step."""
    return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D] rotated by cos, sin [T, D / 2] (first half pairs with second half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
