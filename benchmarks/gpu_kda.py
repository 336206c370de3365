"""KDA cases for benchmarks/gpu_kernels.py: decode at N 1-256 and 8k-token prefills, H 32, K = V = 128
(Kimi-Linear), each with v_split 1 and "auto", against the jnp paths; plus tiny smoke cases."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.gpu_common import Case
from pallas_kernels.kda import kda_beta, kda_gate, kernel, reference

H, K, V = 32, 128, 128
DECODE_ROWS = (1, 8, 32, 64, 128, 256)
PREFILL_LENS = ((8192,), (2048, 2048, 2048, 2048))


def _qkvgb(key, t, h, hv, kd, vd, dtype):
    kq, kk, kv, kg, kb, ka = jax.random.split(key, 6)
    q = jax.random.normal(kq, (t, h, kd), dtype)
    k = jax.random.normal(kk, (t, h, kd), dtype)
    v = jax.random.normal(kv, (t, hv, vd), dtype)
    raw = 2.0 * jax.random.normal(kg, (t, hv, kd), jnp.float32)
    a_log = jnp.log(jax.random.uniform(ka, (hv,), jnp.float32, 0.5, 2.0))
    g = kda_gate(raw, a_log, jnp.zeros(hv * kd, jnp.float32))
    beta = kda_beta(jax.random.normal(kb, (t, hv), jnp.float32)).astype(dtype)
    return q, k, v, g, beta


def _prefill_case(lens, h, hv, kd, vd, dtype, v_split, *, smoke=False) -> Case:
    def make_inputs(key):
        t = sum(lens)
        cu = jnp.cumsum(jnp.asarray((0, *lens), jnp.int32)).astype(jnp.int32)
        s0 = jax.random.normal(jax.random.fold_in(key, 1), (len(lens), hv, vd, kd), jnp.float32)
        return (*_qkvgb(key, t, h, hv, kd, vd, dtype), cu, s0)

    scale = kd**-0.5
    return Case(
        op="kda_prefill",
        name=f"T={sum(lens)} N={len(lens)} H={h} HV={hv} K={kd} V={vd} split={v_split}",
        make_inputs=make_inputs,
        pallas=lambda interpret: functools.partial(
            kernel.kda_prefill, scale=scale, v_split=v_split, interpret=interpret
        ),
        reference=lambda: functools.partial(reference.kda_chunk_reference, scale=scale),
        atol=3e-2,
        rtol=3e-2,
        smoke=smoke,
    )


def _decode_case(rows, h, hv, kd, vd, dtype, v_split, *, smoke=False) -> Case:
    def make_inputs(key):
        slots = rows + 8
        pool = jax.random.normal(jax.random.fold_in(key, 1), (slots, hv, vd, kd), jnp.float32)
        # every fifth row is padding (-1), as in a padded decode bucket
        idx = jnp.where(jnp.arange(rows) % 5 == 4, -1, jnp.arange(rows) + 3).astype(jnp.int32)
        return (*_qkvgb(key, rows, h, hv, kd, vd, dtype), pool, idx)

    scale = kd**-0.5
    return Case(
        op="kda_decode",
        name=f"N={rows} H={h} HV={hv} K={kd} V={vd} split={v_split}",
        make_inputs=make_inputs,
        pallas=lambda interpret: functools.partial(
            kernel.kda_decode, scale=scale, v_split=v_split, interpret=interpret
        ),
        reference=lambda: functools.partial(reference.kda_decode_reference, scale=scale),
        atol=3e-2,
        rtol=3e-2,
        smoke=smoke,
    )


def cases() -> list[Case]:
    out = [
        _decode_case(n, H, H, K, V, jnp.bfloat16, split)
        for n in DECODE_ROWS
        for split in (1, "auto")
    ]
    out += [
        _prefill_case(lens, H, H, K, V, jnp.bfloat16, split)
        for lens in PREFILL_LENS
        for split in (1, "auto")
    ]
    out += [
        _decode_case(5, 2, 4, 32, 32, jnp.float32, 2, smoke=True),
        _prefill_case((0, 17, 5), 2, 4, 32, 32, jnp.bfloat16, 2, smoke=True),
    ]
    return out
