"""Dense attention for encoders and pooling models, with padding expressed by segment ids.

`flash_attention` dispatches through `pallas_kernels.backends`: the jnp reference on CPU, the Pallas
(Triton) kernel on GPUs where it serves the call, and the reference there otherwise.
"""

from __future__ import annotations

from pallas_kernels import backends
from pallas_kernels.flash_attention import kernel, reference

OP = "flash_attention"

__all__ = ["OP", "flash_attention", "select"]


def _check_shapes(q, k, v, segment_ids) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"{OP}: q {q.shape}, k {k.shape}, v {v.shape} must be [B, S, H, D] with k, v alike"
        )
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"{OP}: k {k.shape} must be [{b}, {s}, Hkv, {d}] for q {q.shape}")
    if h % k.shape[2]:
        raise ValueError(f"{OP}: q heads {h} not a multiple of kv heads {k.shape[2]}")
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"{OP}: segment_ids {segment_ids.shape} must be [{b}, {s}]")


def select(q, k, *, causal=False, segment_ids=None, impl="auto", platform=None):
    """The backend choice for a call with these arguments (also usable at engine configuration)."""
    features = {"causal"} if causal else set()
    if segment_ids is not None:
        features.add("segment_ids")
    return backends.select(
        OP,
        impl=impl,
        platform=platform,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        features=features,
        kv_dtype=k.dtype.name if hasattr(k.dtype, "name") else str(k.dtype),
    )


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    sm_scale: float,
    segment_ids=None,
    impl: str = "auto",
    interpret: bool | None = None,
):
    """Attention over [B, S, H, D] inputs; see reference.py for the contract."""
    _check_shapes(q, k, v, segment_ids)
    choice = select(q, k, causal=causal, segment_ids=segment_ids, impl=impl)
    kwargs = dict(causal=causal, sm_scale=sm_scale, segment_ids=segment_ids)
    if choice.impl == "pallas":
        kwargs["interpret"] = choice.interpret if interpret is None else interpret
    return choice.fn(q, k, v, **kwargs)


def _pallas_limits(q: backends.Query) -> str | None:
    kv_dtype = q.extra.get("kv_dtype")
    if q.dtype is not None and kv_dtype is not None and kv_dtype != q.dtype:
        return f"k/v dtype {kv_dtype} differs from q dtype {q.dtype}"
    return None


backends.register(
    backends.Implementation(
        OP,
        "reference",
        fn=reference.flash_attention,
        priority=0,
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        features=frozenset({"causal", "segment_ids"}),
    )
)

backends.register(
    backends.Implementation(
        OP,
        "pallas",
        fn=kernel.flash_attention,
        priority=10,
        platforms=backends.GPU_PLATFORMS,
        interpret_platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # Power-of-two head dims only (block shapes must be). 256 is left to the jnp path until
        # tests/pallas_kernels/test_flash_attention.py covers D=256 in interpret mode and the
        # gpu_kernels benchmark has a D=256 flash case passing (ok=true) on a CUDA and a ROCm device:
        # a [64, 256] f32 accumulator per program is unmeasured against the register budget.
        head_dims=frozenset({16, 32, 64, 128}),
        features=frozenset({"causal", "segment_ids"}),
        check=_pallas_limits,
    )
)
