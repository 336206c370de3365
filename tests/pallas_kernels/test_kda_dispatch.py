"""KDA registration, the v-split rule, the public dispatching entry points, and lowering of both
kernels to Triton for cuda and rocm from this CPU host (production shapes included)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_inputs import prefill_inputs

import pallas_kernels.kda as kda
from pallas_kernels import backends
from pallas_kernels.kda import heuristics, kernel

SDS = jax.ShapeDtypeStruct


def test_v_split_rule():
    assert heuristics.kda_v_split(32, 1, 128, 132) == 4  # 4 * 32 <= 132 < 8 * 32
    assert heuristics.kda_v_split(12, 1, 128, 132) == 8  # capped by 16-wide slices
    assert heuristics.kda_v_split(2, 1, 64, 10_000) == 4
    assert heuristics.kda_v_split(32, 256, 128, 132) == 1
    assert heuristics.kda_v_split(32, 3, 128, 132) == 1  # 2 * 96 > 132
    assert kernel.resolve_v_split("auto", 2, 1, 128, interpret=True) == 1
    assert heuristics.check_v_split(3, 128) is not None
    assert heuristics.check_v_split(16, 128) is not None
    assert heuristics.check_v_split(8, 128) is None
    with pytest.raises(ValueError, match="num_seqs must be >= 1"):
        heuristics.kda_v_split(2, 0, 128, 8)


def test_selection_names_every_reason():
    q = SDS((4, 2, 128), jnp.bfloat16)
    v = SDS((4, 2, 128), jnp.bfloat16)
    for op in (kda.PREFILL, kda.DECODE):
        c = kda.select(op, q, v, platform="cpu")
        assert c.impl == "reference" and "platform 'cpu'" in c.rejected[0][1]
        assert kda.select(op, q, v, platform="cuda").impl == "pallas"
        assert kda.select(op, q, v, platform="rocm", impl="pallas").interpret is False
        assert kda.select(op, q, v, platform="cpu", impl="pallas").interpret is True
        c = kda.select(op, q, v, platform="cuda", v_split=3)
        assert c.impl == "reference" and "v_split must be a power of two" in c.rejected[0][1]
        c = kda.select(op, SDS((4, 2, 96), jnp.float32), v, platform="rocm")
        assert c.impl == "reference" and "K=96" in c.rejected[0][1]
        c = kda.select(op, SDS((4, 2, 128), jnp.float16), v, platform="cuda")
        assert c.impl == "reference" and "dtype float16" in c.rejected[0][1]
        with pytest.raises(backends.BackendError, match="cannot serve"):
            kda.select(op, q, v, platform="cuda", impl="pallas", v_split=16)
    c = kda.select(kda.PREFILL, q, v, platform="cuda", chunk_size=8)
    assert c.impl == "reference" and "chunk_size 8" in c.rejected[0][1]


def test_public_entry_points_agree_across_implementations():
    rng = np.random.default_rng(11)
    lens = (0, 1, 0, 17, 0)
    q, k, v, g, beta, cu, s0 = prefill_inputs(rng, lens, 20, 1, 2, 16, 32, dtype=jnp.float32)

    def both(impl):
        o, s = kda.kda_prefill(q, k, v, g, beta, cu, s0, scale=0.25, impl=impl)
        pool = jnp.full((4, 2, 32, 16), jnp.nan).at[jnp.array([3, 1])].set(s[jnp.array([1, 3])])
        idx = jnp.array([3, -1, 1], jnp.int32)
        rows = jnp.array([0, 19, 5])
        od, pool = kda.kda_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, idx,
                                  scale=0.25, impl=impl)  # fmt: skip
        return o, s, od, pool

    run = jax.jit(both, static_argnums=0)
    for a, b in zip(run("reference"), run("pallas"), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        kda.kda_prefill(q, k, v, g, beta, cu.astype(jnp.float32), s0, scale=1.0)
    with pytest.raises(ValueError, match="state_indices must be int32"):
        kda.kda_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], s0, jnp.zeros(3, jnp.int32), scale=1.0)


def _lower(f, args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernels_lower_to_triton(platform):
    bf, f32 = jnp.bfloat16, jnp.float32
    # (T, N, H, HV, K, V, dtype): Kimi-Linear production heads, GVA, and a small config
    for t, n, h, hv, kd, vd, dt in ((8192, 4, 32, 32, 128, 128, bf), (300, 5, 2, 4, 32, 64, f32)):
        args = (SDS((t, h, kd), dt), SDS((t, h, kd), dt), SDS((t, hv, vd), dt),
                SDS((t, hv, kd), f32), SDS((t, hv), dt), SDS((n + 1,), jnp.int32),
                SDS((n, hv, vd, kd), f32))  # fmt: skip
        for split, chunk in ((1, 16), (2, 32), (4, 64), ("auto", 16)):
            f = lambda *a, s=split, c=chunk, sc=kd**-0.5: kernel.kda_prefill(
                *a, scale=sc, v_split=s, chunk_size=c, interpret=False
            )
            assert "__gpu$xla.gpu.triton" in _lower(f, args, platform), (t, split, chunk)
        rows, slots = 256 if kd == 128 else 3, 512 if kd == 128 else 5
        dargs = (SDS((rows, h, kd), dt), SDS((rows, h, kd), dt), SDS((rows, hv, vd), dt),
                 SDS((rows, hv, kd), f32), SDS((rows, hv), f32), SDS((slots, hv, vd, kd), f32),
                 SDS((rows,), jnp.int32))  # fmt: skip
        for split in (1, 4, "auto"):
            f = lambda *a, s=split, sc=kd**-0.5: kernel.kda_decode(
                *a, scale=sc, v_split=s, interpret=False
            )
            assert "__gpu$xla.gpu.triton" in _lower(f, dargs, platform), (rows, split)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_public_entry_points_honour_interpret_false(platform):
    """Pallas forced on this CPU host runs in interpret mode unless the caller says
    interpret=False; then the public entry points lower to Triton for a GPU (they used to force
    interpret mode whenever the choice was an interpret-mode one)."""
    f32 = jnp.float32
    t, n, h, kd = 40, 3, 2, 32
    args = (SDS((t, h, kd), f32), SDS((t, h, kd), f32), SDS((t, h, kd), f32),
            SDS((t, h, kd), f32), SDS((t, h), f32), SDS((n + 1,), jnp.int32),
            SDS((n, h, kd, kd), f32))  # fmt: skip
    dargs = (SDS((n, h, kd), f32), SDS((n, h, kd), f32), SDS((n, h, kd), f32),
             SDS((n, h, kd), f32), SDS((n, h), f32), SDS((5, h, kd, kd), f32),
             SDS((n,), jnp.int32))  # fmt: skip
    for interpret, triton in ((False, True), (None, False), (True, False)):

        def prefill(*a, i=interpret):
            return kda.kda_prefill(*a, scale=kd**-0.5, impl="pallas", interpret=i)

        def decode(*a, i=interpret):
            return kda.kda_decode(*a, scale=kd**-0.5, impl="pallas", interpret=i)

        for f, a in ((prefill, args), (decode, dargs)):
            text = _lower(f, a, platform)
            assert ("__gpu$xla.gpu.triton" in text) is triton, (f.__name__, interpret)
