"""Sparse MLA decode cases for benchmarks/gpu_kernels.py: DeepSeek V3.2 / V4 decode shapes.

V3.2: T tokens x 128 heads x [512 latent | 64 rope], top-2048 of a 128k-slot pool. V4: 64 heads, a
128-slot window pool plus a top-512 compressed pool, with sinks. Indices are random slots with some
-1 padding; the jnp path is `reference.sparse_mla_decode`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.gpu_common import Case
from pallas_kernels.sparse_mla_decode import kernel, reference

OP = "sparse_mla_decode"


def _indices(key, T, topk, slots):
    k1, k2 = jax.random.split(key)
    idx = jax.random.randint(k1, (T, topk), 0, slots, jnp.int32)
    return jnp.where(jax.random.uniform(k2, (T, topk)) < 0.05, -1, idx)


def _inputs(T, H, D, topk, slots, dtype, extra):
    def make(key):
        ks = jax.random.split(key, 6)
        q = jax.random.normal(ks[0], (T, H, D), dtype)
        kv = jax.random.normal(ks[1], (slots, D), dtype)
        args = [q, kv, _indices(ks[2], T, topk, slots)]
        if extra:
            e_topk, e_slots = extra
            args += [
                jax.random.normal(ks[3], (e_slots, D), dtype),
                _indices(ks[4], T, e_topk, e_slots),
                jax.random.normal(ks[5], (H,), jnp.float32),
            ]
        return args

    return make


def _bind(fn, D, d_v, extra):
    kw = dict(sm_scale=D**-0.5, d_v=d_v)
    if not extra:
        return functools.partial(fn, **kw)

    def call(q, kv, idx, ekv, eidx, sink):
        return fn(q, kv, idx, extra_kv_cache=ekv, extra_indices=eidx, sink=sink, **kw)

    return call


def _case(name, T, H, D, d_v, topk, slots, dtype=jnp.bfloat16, extra=None, smoke=False):
    return Case(
        op=OP,
        name=name,
        make_inputs=_inputs(T, H, D, topk, slots, dtype, extra),
        pallas=lambda interpret: _bind(
            functools.partial(kernel.sparse_mla_decode, interpret=interpret), D, d_v, extra
        ),
        reference=lambda: _bind(reference.sparse_mla_decode, D, d_v, extra),
        atol=2e-2,
        rtol=2e-2,
        smoke=smoke,
    )


def cases() -> list[Case]:
    out = [
        _case(f"v32 T{T} H128 top2048 ctx128k", T, 128, 576, 512, 2048, 131072)
        for T in (1, 2, 8, 32, 64, 128)
    ]
    out.append(_case("v4 T64 H64 swa128+top512", 64, 64, 576, 512, 128, 65536, extra=(512, 32768)))
    out.append(
        _case("smoke T2 H16 D80 top17+17", 2, 16, 80, 64, 17, 64, jnp.float32, (17, 40), True)
    )
    return out
