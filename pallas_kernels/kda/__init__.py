"""Kimi Delta Attention: chunked varlen prefill and pooled-state decode, dispatched by backends.

`kda_prefill` / `kda_decode` pick the Pallas (Triton) kernels on GPUs where they serve the call and
the jnp references otherwise (always on CPU, unless `impl="pallas"` forces interpret mode), with the
reason logged. Shapes and semantics are those of reference.py. `impl` may also be a `Choice` made
earlier (a model decides when it is built); the dispatcher then only confirms it.

`interpret`: None follows the choice (interpret mode where Pallas was forced onto a platform it
cannot compile for); an explicit True or False is honoured, so a CPU host can lower the public
entry points to Triton for cuda or rocm (`interpret=False` under `.lower(lowering_platforms=...)`).
"""

from __future__ import annotations

from pallas_kernels import backends
from pallas_kernels.kda import heuristics, kernel, reference, shapes
from pallas_kernels.kda.gates import kda_beta, kda_gate

__all__ = ["kda_beta", "kda_decode", "kda_gate", "kda_prefill", "select"]

PREFILL, DECODE = "kda_prefill", "kda_decode"
_DTYPES = frozenset({"float32", "bfloat16"})
_GPU = frozenset({"cuda", "rocm"})


def _check(q: backends.Query) -> str | None:
    x = q.extra
    reason = kernel.check_dims(q.head_dim, x["v_dim"])
    if reason is None and x["v_split"] != "auto":
        reason = heuristics.check_v_split(x["v_split"], x["v_dim"])
    if reason is None and x.get("chunk_size", kernel.CHUNK_SIZES[0]) not in kernel.CHUNK_SIZES:
        reason = f"chunk_size {x['chunk_size']} not served (serves {list(kernel.CHUNK_SIZES)})"
    return reason


def select(op: str, q, v, *, v_split="auto", chunk_size=None, impl="auto", platform=None):
    """The backend choice for a KDA call with these arguments (also usable at engine configuration)."""
    extra = {"v_dim": v.shape[-1], "v_split": v_split}
    if chunk_size is not None:
        extra["chunk_size"] = chunk_size
    return backends.select(
        op, impl=impl, platform=platform, dtype=q.dtype, head_dim=q.shape[-1], **extra
    )


def kda_prefill(
    q,
    k,
    v,
    g,
    beta,
    cu_seqlens,
    initial_state=None,
    *,
    scale: float,
    l2norm_qk: bool = True,
    chunk_size: int = 16,
    v_split: int | str = "auto",
    impl: str = "auto",
    interpret: bool | None = None,
):
    """(o [T, HV, V], final_state [N, HV, V, K] float32); `chunk_size` / `v_split` tune speed only.

    The reference runs chunks of `chunk_size` too: its [C, C, HV, K] decay products grow with C,
    and on XLA:CPU C = 64 cost 14x C = 16 (T 512, 4 heads of 128: 865 ms against 62 ms of CPU).
    """
    shapes.check_prefill(PREFILL, q, k, v, g, beta, cu_seqlens, initial_state)
    choice = select(PREFILL, q, v, v_split=v_split, chunk_size=chunk_size, impl=impl)
    args = (q, k, v, g, beta, cu_seqlens, initial_state)
    if choice.impl == "pallas":
        return choice.fn(
            *args, scale=scale, l2norm_qk=l2norm_qk, chunk_size=chunk_size, v_split=v_split,
            interpret=choice.interpret if interpret is None else interpret,
        )  # fmt: skip
    return choice.fn(*args, scale=scale, l2norm_qk=l2norm_qk, chunk_size=chunk_size)


def kda_decode(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    *,
    scale: float,
    l2norm_qk: bool = True,
    v_split: int | str = "auto",
    impl: str = "auto",
    interpret: bool | None = None,
):
    """(o [N, HV, V], state_pool with the rows' slots advanced one token); slot -1 = padding row."""
    shapes.check_decode(DECODE, q, k, v, g, beta, state_pool, state_indices)
    choice = select(DECODE, q, v, v_split=v_split, impl=impl)
    args = (q, k, v, g, beta, state_pool, state_indices)
    if choice.impl == "pallas":
        return choice.fn(
            *args, scale=scale, l2norm_qk=l2norm_qk, v_split=v_split,
            interpret=choice.interpret if interpret is None else interpret,
        )  # fmt: skip
    return choice.fn(*args, scale=scale, l2norm_qk=l2norm_qk)


for _op, _ref, _pallas in (
    (PREFILL, reference.kda_chunk_reference, kernel.kda_prefill),
    (DECODE, reference.kda_decode_reference, kernel.kda_decode),
):
    backends.register(
        backends.Implementation(
            _op, "reference", fn=_ref, priority=0, platforms=frozenset({"cpu"}) | _GPU
        )
    )
    backends.register(
        backends.Implementation(
            _op,
            "pallas",
            fn=_pallas,
            priority=10,
            platforms=_GPU,
            interpret_platforms=frozenset({"cpu"}),
            dtypes=_DTYPES,
            check=_check,
        )
    )
