"""Sparse MLA decode: Pallas kernel (interpret mode, under jit) vs the jnp reference.

Every case builds a batch whose rows cover the index kinds: duplicates, all -1, trailing -1 padding,
a topk_lengths prefix, and -1 / out-of-range ids scattered. Every cache row that no attended entry
selects is NaN, so a scrub that misses a tail or an invalid entry shows up as a NaN output. Outputs
are poisoned too: interpret mode starts every output buffer as NaN (kernels.md C.4), so an element the
kernel never writes reaches the comparison as NaN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backends
from pallas_kernels.sparse_mla_decode import kernel, reference, sparse_mla_decode

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
LSE_TOL = dict(atol=2e-4, rtol=2e-5)


@dataclass(frozen=True, slots=True)
class Case:
    H: int
    D: int
    dv: int
    topk: int
    dtype: type
    extra_topk: int = 0
    sink: bool = False
    lengths: bool = False
    splits: tuple = ("auto",)
    T: int = 5
    slots: int = 96


def _row_indices(rng, T, topk, slots, lengths):
    """int32[T, topk] with one row kind per row, and the per-row lengths (None if unlimited)."""
    idx = rng.integers(1, slots, (T, topk)).astype(np.int32)
    idx[0, topk // 2 :] = idx[0, : topk - topk // 2]  # duplicates
    idx[1] = -1  # nothing valid
    idx[2, (topk + 1) // 2 :] = -1  # trailing padding
    if T > 4:
        holes = rng.random(topk) < 0.3
        idx[4, holes] = rng.choice([-1, slots, slots + 7], holes.sum())  # invalid, out of range
    lens = None
    if lengths:
        lens = np.full(T, topk, np.int32)
        lens[3] = rng.integers(0, topk) if topk > 1 else 0
        lens[0] = topk + 5  # longer than topk: clipped
    return idx, lens


def _attended(idx, lens, slots):
    pos = np.arange(idx.shape[1])[None, :]
    ok = (idx >= 0) & (idx < slots)
    if lens is not None:
        ok &= pos < lens[:, None]
    return set(idx[ok].tolist())


def _pool(rng, slots, D, dtype, attended):
    pool = rng.standard_normal((slots, D)).astype(np.float32)
    pool[[s for s in range(slots) if s not in attended]] = np.nan
    return jnp.asarray(pool, dtype)


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    idx, lens = _row_indices(rng, case.T, case.topk, case.slots, case.lengths)
    q = jnp.asarray(rng.standard_normal((case.T, case.H, case.D)), case.dtype)
    kv = _pool(rng, case.slots, case.D, case.dtype, _attended(idx, lens, case.slots))
    kw = dict(sm_scale=1.5 * case.D**-0.5, d_v=case.dv)
    if lens is not None:
        kw["topk_lengths"] = jnp.asarray(lens)
    if case.sink:
        kw["sink"] = jnp.asarray(rng.standard_normal(case.H) * 2, jnp.float32)
    if case.extra_topk:
        e_slots = 40
        e_idx, e_lens = _row_indices(rng, case.T, case.extra_topk, e_slots, case.lengths)
        e_idx = np.roll(e_idx, 2, axis=0)  # other row kinds than the main pool's in each row
        if e_lens is not None:
            e_lens = np.roll(e_lens, 1)
            kw["extra_topk_lengths"] = jnp.asarray(e_lens)
        kw["extra_kv_cache"] = _pool(
            rng, e_slots, case.D, case.dtype, _attended(e_idx, e_lens, e_slots)
        )
        kw["extra_indices"] = jnp.asarray(e_idx)
    return (q, kv, jnp.asarray(idx)), kw


def check(case: Case, seed: int):
    args, kw = make_inputs(case, seed)
    want_out, want_lse = jax.jit(functools.partial(reference.sparse_mla_decode, **kw))(*args)
    assert np.isfinite(np.asarray(want_out, np.float32)).all()
    for splits in case.splits:
        f = functools.partial(kernel.sparse_mla_decode, interpret=True, num_splits=splits, **kw)
        out, lse = jax.jit(f)(*args)
        assert out.shape == (case.T, case.H, case.dv) and out.dtype == case.dtype
        assert lse.shape == (case.T, case.H) and lse.dtype == jnp.float32
        msg = f"{case} splits={splits}"
        o = np.asarray(out, np.float32)
        assert np.isfinite(o).all(), msg
        np.testing.assert_allclose(
            o, np.asarray(want_out, np.float32), **TOL[case.dtype], err_msg=msg
        )
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **LSE_TOL, err_msg=msg)


SMALL = [
    Case(H=1, D=80, dv=64, topk=1, dtype=jnp.float32, splits=(1, 2)),
    Case(H=16, D=80, dv=64, topk=17, dtype=jnp.bfloat16, sink=True, lengths=True, splits=(1, 2)),
    Case(
        H=64,
        D=80,
        dv=64,
        topk=64,
        dtype=jnp.float32,
        extra_topk=17,
        sink=True,
        lengths=True,
        splits=(1, 2, 3, 4),
    ),
    Case(H=128, D=80, dv=64, topk=64, dtype=jnp.bfloat16, extra_topk=40, T=4),
    Case(H=16, D=80, dv=64, topk=2048, dtype=jnp.float32, lengths=True, splits=(7,), T=4),
]
DEEPSEEK = [
    Case(H=1, D=576, dv=512, topk=17, dtype=jnp.float32, lengths=True, splits=("auto", 3)),
    Case(
        H=16,
        D=576,
        dv=512,
        topk=64,
        dtype=jnp.bfloat16,
        extra_topk=17,
        sink=True,
        lengths=True,
        splits=(1, 2, 3, 4),
    ),
    Case(
        H=64,
        D=576,
        dv=512,
        topk=1,
        dtype=jnp.float32,
        extra_topk=64,
        sink=True,
        lengths=True,
        splits=(1, 2, 3, 4),
    ),
    Case(
        H=128,
        D=576,
        dv=512,
        topk=2048,
        dtype=jnp.bfloat16,
        extra_topk=64,
        sink=True,
        T=4,
        slots=2500,
        splits=("auto", 5),
    ),
]


@pytest.mark.parametrize("i", range(len(SMALL)))
def test_small_config_matches_reference(i):
    check(SMALL[i], seed=i)


@pytest.mark.parametrize("i", range(len(DEEPSEEK)))
def test_deepseek_config_matches_reference(i):
    check(DEEPSEEK[i], seed=100 + i)


def test_nan_free_path_needs_finite_rows():
    case = Case(
        H=16, D=80, dv=64, topk=33, dtype=jnp.float32, extra_topk=17, sink=True, lengths=True
    )
    (q, kv, idx), kw = make_inputs(case, seed=7)
    ref = jax.jit(functools.partial(reference.sparse_mla_decode, **kw))(q, kv, idx)
    fin_kw = dict(kw, extra_kv_cache=jnp.nan_to_num(kw["extra_kv_cache"], nan=3.0))
    fin_kv = jnp.nan_to_num(kv, nan=3.0)
    fin_ref = jax.jit(functools.partial(reference.sparse_mla_decode, **fin_kw))(q, fin_kv, idx)
    # Unselected bytes are irrelevant: only the attended rows decide the result.
    np.testing.assert_allclose(fin_ref[0], ref[0], **TOL[jnp.float32])
    for splits in (1, 2):
        f = functools.partial(
            kernel.sparse_mla_decode, interpret=True, nan_free=True, num_splits=splits, **fin_kw
        )
        out, lse = jax.jit(f)(q, fin_kv, idx)
        np.testing.assert_allclose(out, ref[0], **TOL[jnp.float32])
        np.testing.assert_allclose(lse, ref[1], **LSE_TOL)
    # Skipping the scrub on the poisoned pool does let NaN through, so the scrub is what keeps
    # every other case finite (the NaN rows are really read when invalid entries are gathered).
    f = functools.partial(kernel.sparse_mla_decode, interpret=True, nan_free=True, **kw)
    assert np.isnan(np.asarray(jax.jit(f)(q, kv, idx)[0])).any()


def test_public_entry_dispatches_and_agrees():
    case = Case(H=16, D=80, dv=64, topk=17, dtype=jnp.float32, extra_topk=17, sink=True)
    args, kw = make_inputs(case, seed=11)
    assert backends.select("sparse_mla_decode", dtype=jnp.float32, head_dim=80, d_v=64).impl == (
        "reference"
    )
    got = {
        impl: jax.jit(functools.partial(sparse_mla_decode, impl=impl, **kw))(*args)
        for impl in ("auto", "reference", "pallas")
    }
    for impl in ("reference", "pallas"):
        np.testing.assert_allclose(got[impl][0], got["auto"][0], **TOL[jnp.float32])
        np.testing.assert_allclose(got[impl][1], got["auto"][1], **LSE_TOL)


def test_pallas_rejects_layouts_it_cannot_tile():
    c = backends.select(
        "sparse_mla_decode", platform="cuda", dtype=jnp.bfloat16, head_dim=584, d_v=512
    )
    assert c.impl == "reference" and "multiple of 16" in dict(c.rejected)["pallas"]
    with pytest.raises(backends.BackendError, match="d_v 48"):
        backends.select(
            "sparse_mla_decode",
            impl="pallas",
            platform="cuda",
            dtype=jnp.float32,
            head_dim=64,
            d_v=48,
        )
    assert (
        backends.select(
            "sparse_mla_decode", platform="rocm", dtype=jnp.bfloat16, head_dim=576, d_v=512
        ).impl
        == "pallas"
    )


def test_bad_arguments_name_the_value():
    case = Case(H=4, D=80, dv=64, topk=8, dtype=jnp.float32, T=4)
    (q, kv, idx), kw = make_inputs(case, seed=3)
    bad = [
        (dict(q=q[0]), "q must be"),
        (dict(q=q[:0]), "q must be"),
        (dict(kv=kv[:, :64]), "main cache must be"),
        (dict(kv=kv.astype(jnp.bfloat16)), "kv_cache dtype"),
        (dict(idx=idx.astype(jnp.float32)), "main indices must be int32"),
        (dict(idx=idx[:2]), "main indices must be"),
        (dict(d_v=96), "d_v must be"),
        (dict(sm_scale=-1.0), "sm_scale"),
        (dict(sink=jnp.zeros(3)), "sink must be"),
        (dict(extra_kv_cache=kv), "given together"),
        (dict(extra_topk_lengths=jnp.zeros(4, jnp.int32)), "without an extra pool"),
        (dict(topk_lengths=jnp.zeros(3, jnp.int32)), "topk_lengths must be"),
        (dict(num_splits=0), "num_splits"),
    ]
    for change, match in bad:
        a = dict(q=q, kv=kv, idx=idx, **kw)
        a.update(change)
        call = functools.partial(sparse_mla_decode, a.pop("q"), a.pop("kv"), a.pop("idx"))
        with pytest.raises(ValueError, match=match):
            call(**a)


def test_lowers_for_cuda_and_rocm():
    sds = jax.ShapeDtypeStruct
    shapes = [
        # DeepSeek V3.2 production decode and a V4-style call with a window + compressed pool.
        (64, 128, 576, 512, 2048, 131072, jnp.bfloat16, {}),
        (
            16,
            64,
            576,
            512,
            128,
            8192,
            jnp.bfloat16,
            dict(
                extra_kv_cache=sds((32768, 576), jnp.bfloat16),
                extra_indices=sds((16, 512), jnp.int32),
                extra_topk_lengths=sds((16,), jnp.int32),
                sink=sds((64,), jnp.float32),
                topk_lengths=sds((16,), jnp.int32),
            ),
        ),
        (4, 16, 80, 64, 17, 1000, jnp.float32, dict(sink=sds((16,), jnp.float32))),
    ]
    for T, H, D, dv, topk, slots, dtype, extra in shapes:
        args = (sds((T, H, D), dtype), sds((slots, D), dtype), sds((T, topk), jnp.int32))
        for nan_free in (False, True):
            f = functools.partial(
                kernel.sparse_mla_decode,
                sm_scale=D**-0.5,
                d_v=dv,
                nan_free=nan_free,
                num_splits=4,
                interpret=False,
            )
            for plat in ("cuda", "rocm"):
                text = jax.jit(f).trace(*args, **extra).lower(lowering_platforms=(plat,)).as_text()
                assert "__gpu$xla.gpu.triton" in text, (plat, T, H, D)
