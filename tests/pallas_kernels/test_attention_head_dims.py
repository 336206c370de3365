"""Backend selection at head dims 64, 128 and 256 on every platform, without a GPU (issue 17 item 4).

vLLM PR 52050: ColPali's Gemma backbone has head dim 256, which the newer attention kernel could
not serve with the arguments vLLM always passes, so it crashed at the first step. Here every
attention op the registry offers either serves the head dim or is passed over with its reason,
logged once when the choice is made, for every platform name; and a call passing a bidirectional
prefix (PaliGemma's prefix LM) is served only by an implementation that declares it.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backends, kda
from pallas_kernels import flash_attention as dense
from pallas_kernels import ragged_paged_attention as rpa

PLATFORMS = ("cpu", "cuda", "rocm")
HEAD_DIMS = (64, 128, 256)
NOT_ON_CPU = "platform 'cpu' not served (serves ['cuda', 'rocm'])"
NOT_256 = "head_dim 256 not served (serves [16, 32, 64, 128])"
NOT_PREFIX = "features ['prefix_lm'] not served (serves ['ragged', 'sliding_window', 'soft_cap'])"


def _paged(hd, platform, prefix_lm=False):
    q = jax.ShapeDtypeStruct((1, 8, hd), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 16, 1, hd), jnp.bfloat16)
    return rpa.select(q, k, prefix_lm=prefix_lm, platform=platform)


def _dense(hd, platform):
    q = jax.ShapeDtypeStruct((1, 64, 4, hd), jnp.bfloat16)
    return dense.select(
        q, q, causal=False, segment_ids=jnp.zeros((1, 64), jnp.int32), platform=platform
    )


# (name, select(hd, platform), {(platform, hd): (impl, {rejected impl: reason})})
def _expected(gpu_limits: dict[int, str | None]) -> dict:
    out = {}
    for hd in HEAD_DIMS:
        out["cpu", hd] = ("reference", {"pallas": NOT_ON_CPU})
        for gpu in ("cuda", "rocm"):
            reason = gpu_limits[hd]
            out[gpu, hd] = ("pallas", {}) if reason is None else ("reference", {"pallas": reason})
    return out


CASES = [
    ("ragged_paged_attention", _paged, _expected({64: None, 128: None, 256: NOT_256})),
    (
        "ragged_paged_attention + prefix_lm (PaliGemma)",
        lambda hd, p: _paged(hd, p, prefix_lm=True),
        _expected({64: NOT_PREFIX, 128: NOT_PREFIX, 256: NOT_256}),
    ),
    ("flash_attention (encoders, SigLIP)", _dense, _expected({64: None, 128: None, 256: NOT_256})),
]


def test_choice_and_reason_for_every_platform_and_head_dim(caplog):
    failures = []
    for name, select, expected in CASES:
        for platform in PLATFORMS:
            for hd in HEAD_DIMS:
                caplog.clear()
                with caplog.at_level(logging.INFO, logger="pallas_kernels.backends"):
                    choice = select(hd, platform)
                want_impl, want_rejected = expected[platform, hd]
                case = f"{name} on {platform} at head dim {hd}"
                if choice.impl != want_impl or dict(choice.rejected) != want_rejected:
                    failures.append(
                        f"{case}: chose {choice.impl} rejecting {dict(choice.rejected)}, "
                        f"expected {want_impl} rejecting {want_rejected}"
                    )
                    continue
                logged = [r.getMessage() for r in caplog.records]
                if len(logged) != 1 or any(
                    reason not in logged[0] for reason in want_rejected.values()
                ):
                    failures.append(f"{case}: logged {logged}, expected one line with the reasons")
    assert not failures, "\n".join(failures)


def _kda(op):
    def select(hd, platform):
        x = jax.ShapeDtypeStruct((1, 1, hd), jnp.bfloat16)
        return kda.select(op, x, x, platform=platform)

    return select


def _sparse_mla(hd, platform):
    # MLA shapes: the latent (d_v = hd) plus a 64-wide rope part as the q/k head dim.
    return backends.select(
        "sparse_mla_decode",
        platform=platform,
        dtype=jnp.bfloat16,
        head_dim=hd + 64,
        d_v=hd,
    )


def test_every_registered_attention_op_serves_or_passes_over_with_a_reason(caplog):
    """The property, over every attention op in the registry (the two above and the KDA and
    sparse MLA ones): the chosen implementation serves the call it was chosen for, and every
    better-ranked one is passed over with a reason that the one log line carries."""
    ops = {
        "ragged_paged_attention": _paged,
        "flash_attention": _dense,
        "sparse_mla_decode": _sparse_mla,
        "kda_prefill": _kda(kda.PREFILL),
        "kda_decode": _kda(kda.DECODE),
    }
    failures = []
    for op, select in ops.items():
        impls = backends.implementations(op)
        for platform in PLATFORMS:
            for hd in HEAD_DIMS:
                caplog.clear()
                with caplog.at_level(logging.INFO, logger="pallas_kernels.backends"):
                    choice = select(hd, platform)
                case = f"{op} on {platform} at head dim {hd}"
                chosen = impls[choice.impl]
                better = {n for n, i in impls.items() if i.priority > chosen.priority}
                if set(dict(choice.rejected)) != better:
                    failures.append(f"{case}: rejected {choice.rejected}, better ones {better}")
                if any(not reason for _, reason in choice.rejected):
                    failures.append(f"{case}: a rejection without a reason: {choice.rejected}")
                logged = " ".join(r.getMessage() for r in caplog.records)
                if choice.impl not in logged or any(r not in logged for _, r in choice.rejected):
                    failures.append(f"{case}: the log {logged!r} lacks the choice or a reason")
    assert not failures, "\n".join(failures)


def test_forced_pallas_at_head_dim_256_fails_at_configuration():
    """A forced implementation that cannot serve hd 256 fails when chosen, naming the reason,
    never inside a jitted step (PR 52050's AssertionError came at the first forward)."""
    q = jax.ShapeDtypeStruct((1, 8, 256), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 16, 1, 256), jnp.bfloat16)
    with pytest.raises(backends.BackendError, match="head_dim 256 not served"):
        rpa.select(q, k, impl="pallas", platform="cuda")
    q = jax.ShapeDtypeStruct((1, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 16, 1, 64), jnp.bfloat16)
    with pytest.raises(backends.BackendError, match=r"features \['prefix_lm'\] not served"):
        rpa.select(q, k, prefix_lm=True, impl="pallas", platform="cuda")


def test_prefix_lens_call_is_confirmed_against_the_prefix_lm_feature():
    """A layer that chose a backend without the prefix-LM feature cannot pass prefix_lens to it:
    the dispatcher's confirmation re-checks every argument of the call."""
    q = jnp.zeros((4, 2, 64), jnp.float32)
    cache = jnp.zeros((2, 4, 1, 64), jnp.float32)
    args = (q, cache, cache, jnp.array([4]), jnp.array([[0, 1]]), jnp.array([0, 4]), jnp.array(1))
    forced = rpa.select(q, cache, impl="pallas", platform="cpu")  # interpret mode, no prefix_lm
    with pytest.raises(backends.BackendError, match="prefix_lm"):
        rpa.ragged_paged_attention(*args, sm_scale=0.125, prefix_lens=jnp.array([4]), impl=forced)
    out = rpa.ragged_paged_attention(*args, sm_scale=0.125, prefix_lens=jnp.array([4]))
    assert out.shape == q.shape
