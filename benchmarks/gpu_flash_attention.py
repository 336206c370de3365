"""GPU benchmark cases for dense flash attention: encoder batches with padding segments."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.gpu_common import Case
from pallas_kernels.flash_attention import kernel, reference

OP = "flash_attention"


def _inputs(key, *, b, s, h, hkv, d, dtype, segments):
    """Random q/k/v; each row is one sequence of random length followed by padding (segment 0)."""
    kq, kk, kv, kl = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, h, d), dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), dtype)
    if not segments:
        return q, k, v, None
    lens = jax.random.randint(kl, (b, 1), s // 2, s + 1)
    seg = jnp.where(jnp.arange(s)[None, :] < lens, 1, 0).astype(jnp.int32)
    return q, k, v, seg


def _case(name, *, b, s, h, hkv, d, causal, segments=True, dtype=jnp.bfloat16, smoke=False):
    attn = dict(causal=causal, sm_scale=d**-0.5)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4

    def pallas(interpret):
        return lambda q, k, v, seg: kernel.flash_attention(
            q, k, v, segment_ids=seg, interpret=interpret, **attn
        )

    return Case(
        op=OP,
        name=name,
        make_inputs=functools.partial(
            _inputs, b=b, s=s, h=h, hkv=hkv, d=d, dtype=dtype, segments=segments
        ),
        pallas=pallas,
        reference=lambda: (
            lambda q, k, v, seg: reference.flash_attention(q, k, v, segment_ids=seg, **attn)
        ),
        atol=tol,
        rtol=tol,
        smoke=smoke,
    )


def cases() -> list[Case]:
    return [
        _case("bert-base b32 s512 h12 d64", b=32, s=512, h=12, hkv=12, d=64, causal=False),
        _case("minilm b64 s128 h12 d32", b=64, s=128, h=12, hkv=12, d=32, causal=False),
        _case("causal pooling b4 s2000 h32/8 d128", b=4, s=2000, h=32, hkv=8, d=128, causal=True),
        _case(
            "smoke f32 s37 gqa",
            b=2,
            s=37,
            h=4,
            hkv=1,
            d=16,
            causal=True,
            dtype=jnp.float32,
            smoke=True,
        ),
        _case(
            "smoke bf16 s70 no segments",
            b=1,
            s=70,
            h=2,
            hkv=2,
            d=32,
            causal=False,
            segments=False,
            smoke=True,
        ),
    ]
