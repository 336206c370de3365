"""DeepSeek sparse MLA decode (V3.2 DSA / V4) and the lightning indexer that picks its top-k slots.

`sparse_mla_decode` dispatches through the backend registry: the Pallas kernel on GPUs, the jnp
reference on the CPU (the Pallas kernel runs there only when forced, in interpret mode).
"""

from __future__ import annotations

from pallas_kernels import backends
from pallas_kernels.sparse_mla_decode import kernel, reference
from pallas_kernels.sparse_mla_decode.indexer import indexer_topk

OP = "sparse_mla_decode"
FEATURES = frozenset({"topk_lengths", "sink", "extra_pool"})


def _pallas_check(q: backends.Query) -> str | None:
    return kernel.kernel_limits(q.head_dim, q.extra["d_v"])


backends.register(
    backends.Implementation(
        OP,
        "reference",
        fn=reference.sparse_mla_decode,
        priority=0,
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=reference.DTYPES,
        features=FEATURES,
    )
)
backends.register(
    backends.Implementation(
        OP,
        "pallas",
        fn=kernel.sparse_mla_decode,
        priority=10,
        platforms=backends.GPU_PLATFORMS,
        interpret_platforms=frozenset({"cpu"}),
        dtypes=reference.DTYPES,
        features=FEATURES,
        check=_pallas_check,
    )
)


def sparse_mla_decode(
    q,
    kv_cache,
    indices,
    *,
    sm_scale,
    d_v,
    topk_lengths=None,
    sink=None,
    extra_kv_cache=None,
    extra_indices=None,
    extra_topk_lengths=None,
    nan_free=False,
    num_splits="auto",
    impl="auto",
    interpret=None,
):
    """(out [T, H, d_v], lse f32[T, H]); the contract is documented in `reference`.

    `num_splits` forces the kernel's split count (the reference has a single path and ignores it);
    `impl` forces an implementation and raises `BackendError` if it cannot serve the call.
    """
    kernel.check_num_splits(num_splits)
    features = {
        name
        for name, arg in (
            ("topk_lengths", topk_lengths if topk_lengths is not None else extra_topk_lengths),
            ("sink", sink),
            ("extra_pool", extra_kv_cache),
        )
        if arg is not None
    }
    choice = backends.select(
        OP, impl=impl, dtype=q.dtype, head_dim=q.shape[-1], features=features, d_v=d_v
    )
    kw = dict(
        sm_scale=sm_scale,
        d_v=d_v,
        topk_lengths=topk_lengths,
        sink=sink,
        extra_kv_cache=extra_kv_cache,
        extra_indices=extra_indices,
        extra_topk_lengths=extra_topk_lengths,
        nan_free=nan_free,
    )
    if choice.impl == "pallas":
        kw["num_splits"] = num_splits
        kw["interpret"] = choice.interpret if interpret is None else interpret
    return choice.fn(q, kv_cache, indices, **kw)


__all__ = ["OP", "indexer_topk", "sparse_mla_decode"]
