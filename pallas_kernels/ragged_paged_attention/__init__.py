"""Ragged paged attention over a flat batch of prefill chunks and decodes, and the KV cache write.

`ragged_paged_attention` dispatches through `pallas_kernels.backends`: the jnp reference on CPU, the
Pallas (Triton) kernel on GPUs where it serves the call, and the reference there otherwise, with the
reason logged. On the jnp path, where the C++ kernels serve (native.py) they read every step in
place: a decode step whose caller counted its live chunks (`decode_chunks`) through the decode
kernel, any other step (causal or a prefix LM's) through the prefill kernel. Elsewhere a decode
step attends only its live context (decode.py gathers those chunks), and so does another causal
step whose caller counted its live (query tile, KV chunk) pairs (`tile_chunks`: tiles.py); the
rest take the reference. A model decides once,
with `select` on its layers' shapes when it is built, and passes that `Choice` as `impl`; the
dispatcher then only confirms it serves the call.
"""

from __future__ import annotations

from pallas_kernels import backends
from pallas_kernels.ragged_paged_attention import decode, kernel, native, reference, tiles
from pallas_kernels.ragged_paged_attention.cache_write import write_kv
from pallas_kernels.ragged_paged_attention.heuristics import MAX_ROWS
from pallas_kernels.ragged_paged_attention.work_items import pow2_ceil

OP = "ragged_paged_attention"

__all__ = ["OP", "ragged_paged_attention", "write_kv"]


def _check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs) -> None:
    if q.ndim != 3:
        raise ValueError(f"{OP}: q must be [T, Hq, D], got shape {q.shape}")
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{OP}: k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be "
            "[num_blocks, block_size, Hkv, D]"
        )
    t, hq, d = q.shape
    _, _, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"{OP}: cache head dim {dk} != q head dim {d}")
    if hq % hkv:
        raise ValueError(f"{OP}: q heads {hq} not a multiple of kv heads {hkv}")
    if block_tables.ndim != 2:
        raise ValueError(f"{OP}: block_tables must be [S, max_blocks], got {block_tables.shape}")
    s = block_tables.shape[0]
    if kv_lens.shape != (s,) or cu_q_lens.shape != (s + 1,):
        raise ValueError(
            f"{OP}: kv_lens {kv_lens.shape} and cu_q_lens {cu_q_lens.shape} must be [{s}] and "
            f"[{s + 1}] for block_tables {block_tables.shape}"
        )
    if getattr(num_seqs, "shape", ()) not in ((), (1,)):
        raise ValueError(f"{OP}: num_seqs must be a scalar, got shape {num_seqs.shape}")


def features_of(sliding_window, soft_cap, prefix_lm: bool = False) -> frozenset[str]:
    f = {"ragged"}
    if prefix_lm:
        f.add("prefix_lm")
    if sliding_window is not None:
        f.add("sliding_window")
    if soft_cap is not None:
        f.add("soft_cap")
    return frozenset(f)


def select(
    q, k_cache, *, sliding_window=None, soft_cap=None, prefix_lm=False, impl="auto", platform=None
):
    """The backend choice for a call with these arguments; `q` and `k_cache` may be
    `jax.ShapeDtypeStruct`s, so a model can decide when it is built, before any array exists.
    `prefix_lm`: the call passes prefix_lens (a bidirectional prefix per sequence)."""
    return backends.select(
        OP,
        impl=impl,
        platform=platform,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        features=features_of(sliding_window, soft_cap, prefix_lm),
        kv_dtype=k_cache.dtype.name if hasattr(k_cache.dtype, "name") else str(k_cache.dtype),
        block_size=k_cache.shape[1],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
    )


def ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_splits: int | str = "auto",
    prefix_lens=None,
    decode_chunks: int = 0,
    tile_chunks: int = 0,
    round_probabilities: bool = True,
    narrow_dots: bool = False,
    impl: str | backends.Choice = "auto",
    interpret: bool | None = None,
):
    """Causal attention of a flat token batch against a paged KV cache; see reference.py for shapes.

    `impl` is a `Choice` made earlier by `select` (confirmed, not re-decided), or "auto" / an
    implementation's name to decide here. `num_kv_splits` ("auto" or an int) only affects the Pallas
    kernel; every split count gives the same result within float tolerance. `prefix_lens`
    int32[S] makes each sequence's first prefix_lens[s] positions attend both ways (a prefix LM);
    only implementations declaring the "prefix_lm" feature serve it. `decode_chunks` > 0 promises
    a step of at most one query token per sequence whose live chunks (`decode.live_chunks`) number
    at most that; the jnp path then gathers only those (decode.py), other paths ignore it.
    `tile_chunks` > 0 promises a step whose live (query tile, KV chunk) pairs (`tiles.tile_chunks`)
    number at most that; the jnp path then attends only those (tiles.py) unless `prefix_lens` is
    given (a prefix widens a tile's reach past what that count sees), other paths ignore it.
    `round_probabilities`: on the jnp path, bf16 queries' probabilities are rounded where HF's
    attention rounds them through torch's flash kernel (rounding.py); False keeps them f32, as
    HF's math path does (MLA: q/k and v head dims differ there), through the reference.
    `narrow_dots`: the caller's word that the caches hold values exact in q's dtype (a bf16
    model's keys and values, whatever the cache dtype); the jnp fast paths then take their dots'
    operands in that dtype, accumulating in f32 as before (decode.dot_dtypes): the same values
    at a host's native bf16 dot speed. Other paths ignore it.
    """
    _check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{OP}: sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{OP}: soft_cap must be > 0 or None, got {soft_cap}")
    if num_kv_splits != "auto" and (
        not isinstance(num_kv_splits, int) or isinstance(num_kv_splits, bool) or num_kv_splits < 1
    ):
        raise ValueError(
            f"{OP}: num_kv_splits must be 'auto' or an int >= 1, got {num_kv_splits!r}"
        )
    if prefix_lens is not None:
        if sliding_window is not None:
            raise ValueError(f"{OP}: prefix_lens with a sliding window is not served")
        if prefix_lens.shape != kv_lens.shape:
            raise ValueError(
                f"{OP}: prefix_lens {prefix_lens.shape} must be [S] like kv_lens {kv_lens.shape}"
            )
    choice = select(
        q,
        k_cache,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        prefix_lm=prefix_lens is not None,
        impl=impl,
    )
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if prefix_lens is not None:
        kwargs["prefix_lens"] = prefix_lens
    if choice.impl == "pallas":
        kwargs["num_kv_splits"] = num_kv_splits
        kwargs["interpret"] = choice.interpret if interpret is None else interpret
    for name, count in (("decode_chunks", decode_chunks), ("tile_chunks", tile_chunks)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{OP}: {name} must be an int >= 0, got {count!r}")
    if decode_chunks and tile_chunks:
        raise ValueError(
            f"{OP}: a step is a decode step (decode_chunks={decode_chunks}) or not "
            f"(tile_chunks={tile_chunks}), not both"
        )
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    if choice.impl == "reference" and not round_probabilities:
        return reference.ragged_paged_attention(*args, round_probabilities=False, **kwargs)
    fast = dict(kwargs, narrow_dots=narrow_dots)
    if choice.impl == "reference":
        if decode_chunks:
            if native.serves("decode", q, k_cache):
                return native.decode(*args, **kwargs)
            return decode.ragged_paged_decode(*args, num_chunks=decode_chunks, **fast)
        # Every other step, causal or a prefix LM's, tiled or not (an image model's steps keep
        # table-width buckets and no pair count): the native kernel serves any rows.
        if native.serves("prefill", q, k_cache):
            return native.prefill(*args, **kwargs)
        if tile_chunks and prefix_lens is None:
            return tiles.ragged_paged_tiles(*args, num_pairs=tile_chunks, **fast)
    return choice.fn(*args, **kwargs)


backends.register(
    backends.Implementation(
        OP,
        "reference",
        fn=reference.ragged_paged_attention,
        priority=0,
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        features=frozenset({"ragged", "sliding_window", "soft_cap", "prefix_lm"}),
    )
)


def _pallas_limits(q: backends.Query) -> str | None:
    kv_dtype = q.extra.get("kv_dtype")
    if q.dtype is not None and kv_dtype is not None and kv_dtype != q.dtype:
        return f"kv cache dtype {kv_dtype} differs from q dtype {q.dtype} (no quantized KV yet)"
    bs = q.extra.get("block_size")
    if bs is not None and (bs & (bs - 1) or not 1 <= bs <= 128):
        return f"block_size {bs} not a power of two in [1, 128]"
    hq, hkv = q.extra.get("num_q_heads"), q.extra.get("num_kv_heads")
    if hq is not None and hkv is not None and pow2_ceil(hq // hkv) > MAX_ROWS:
        return f"GQA group {hq // hkv} above {MAX_ROWS} q heads per kv head"
    return None


backends.register(
    backends.Implementation(
        OP,
        "pallas",
        fn=kernel.ragged_paged_attention,
        priority=10,
        platforms=backends.GPU_PLATFORMS,
        interpret_platforms=frozenset({"cpu"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        # Power-of-two head dims only (block shapes must be). 256 is left to the jnp path: its
        # [rows, 256] f32 accumulator plus a [64, 256] K/V tile per step has not been shown to fit a
        # program's registers; restore it once tests/pallas_kernels/test_ragged_paged_attention.py
        # covers D=256 in interpret mode and the gpu_kernels benchmark has a D=256 case passing
        # (ok=true) on both a CUDA and a ROCm device.
        head_dims=frozenset({16, 32, 64, 128}),
        # No "prefix_lm": its KV walk stops at each query's causal diagonal (vLLM PR 52050's
        # lesson: a call passing prefix_lens goes to an implementation that honours it).
        features=frozenset({"ragged", "sliding_window", "soft_cap"}),
        check=_pallas_limits,
    )
)
