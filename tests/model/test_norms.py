"""RMSNorm against transformers' LlamaRMSNorm on the inputs where its details show: activations small
enough that eps matters, and bf16, where HF rounds the normalised activations before the scale."""

import numpy as np
import pytest

from model.layers.norms import rms_norm

EPS = 1e-6


def _hf_rms_norm(x, weight, eps, dtype):
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(weight))
        norm = norm.to(getattr(torch, dtype))
        out = norm(torch.from_numpy(x).to(getattr(torch, dtype)))
    return out.float().numpy()


def _inputs(scale):
    rng = np.random.default_rng(0)
    x = (scale * rng.standard_normal((64, 128))).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, 128).astype(np.float32)
    return x, weight


@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_f32_matches_hf_where_eps_is_comparable_to_the_variance(scale):
    # At scale 1e-3 the variance is ~1e-6 = eps: dropping eps would scale the output by sqrt(2).
    x, weight = _inputs(scale)
    ours = np.asarray(rms_norm(x, weight, EPS))
    np.testing.assert_allclose(ours, _hf_rms_norm(x, weight, EPS, "float32"), rtol=1e-5, atol=1e-6)


def test_bf16_rounds_like_hf_before_the_scale():
    import jax.numpy as jnp

    x, weight = _inputs(1.0)
    ours = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16), EPS)
    ours = np.asarray(ours.astype(jnp.float32))
    hf = _hf_rms_norm(x, weight, EPS, "bfloat16")
    # Rounding once after the scale instead of before it changes about a quarter of the values by
    # one bf16 ulp; a different f32 summation order flips only values on a rounding boundary.
    assert np.mean(ours == hf) > 0.999, np.mean(ours == hf)
