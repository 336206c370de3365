"""Attention on the CPU read in place from the paged cache, and the cache write: C++ kernels
(native/*.cc, XLA FFI custom calls).

On the jnp path XLA:CPU cannot read the cache through the block tables inside a dot or a
reduction: each layer first copies the pages it attends (decode.py gathers every live page of K
and V; tiles.py each (tile, chunk) pair's), and its small batched dots run on one core. These
kernels read each sequence's keys and values where they lie and split the work over XLA's
intra-op threads. Measured per layer on a 2-core Xeon (AVX-512, f32, 8 query and 2 kv heads of
64, median of 21-31):
- decode (native/decode.cc), 64 sequences, contexts 100..600 in blocks placed at random:
  decode.py 5.5-5.9 ms, 0.9-1.0 here (f32 or bf16 caches). Each sequence is a work item: each
  key widened once for its kv head's query heads, 16 keys' dots summed together (one key's dot
  summed alone cost 1.35 ms f32, 1.7 bf16), the next rows prefetched (1.15-1.35 ms without), a
  two-pass softmax, each value row widened once for four heads' register accumulators.
- every other causal or prefix-LM step (native/prefill.cc), 2048 tokens of 11 rows (prompts of 39..441
  tokens and a 200-token chunk continuing a 400-token context): tiles.py 35.3 ms, 5.6 here (7.2
  with bf16 queries and caches; 7.7 and 8.9 before the changes below, measured alike). A work item is a tile
  of one sequence's tokens and one kv head; its rows score 16 keys at a time, eight rows at once,
  against a copy of those keys transposed in registers (a scalar copy cost more than the dots),
  take a softmax whose exp and sum are one 16-lane pass (the compiler's own loops were 8 lanes
  and four passes), then sum the values four rows at a time (bf16 rows widened once per tile).
  A row's softmax folds its lanes' maximum and sum in halves, and its exp builds 2^n as one
  float (below e^-87 it is 0, under f32's resolution of a sum holding the maximum's 1): on
  bidirectional rows of 12 heads of 32 (an encoder step of 15 sentences of 8..256 tokens) 5.2
  against 5.7 ms, those prompts 4.55 against 4.8, a 2048-token chunk after 2048 cached 78.7
  against 81.9 (three runs each, alternating).
- the cache write (native/write.cc): each token's row copied to its slot, the cache the call's
  output aliasing its donated input. XLA:CPU scatters bf16 by rewriting the whole cache as f32
  around it (bitcast.py's uint16 view did not avoid the copies inside the step), so bf16 caches
  were slower than f32 ones; with this write and the kernels' bf16 reads they are not, and a bf16
  model keeps bf16 caches where these build (runtime/runner/cpu_bf16.py): half the memory.

The attention kernels serve f32 or bf16 caches with f32 or bf16 queries (a bf16 model's
probabilities rounded to bf16 relative to the running maximum over HF's key blocks, as
rounding.py says), head dims in `HEAD_DIMS`, on the CPU where the libraries build
(pallas_kernels/native_build.py, on first use; each attention library is built for the one head
dim a model uses, ~3 s where every head dim took ~9; otherwise it logs why, once, and the jnp
paths serve). Results are the reference's within f32 rounding (other summation order, their own
exp; a bf16 output may differ by one ulp), with its rules: keys a query does not attend are never
read, an attended non-finite value row makes the heads reading it NaN (masked_values.py), and a
step the kernel does not serve (decode: a row with more than one query token; prefill: more query
tokens than context) is all NaN. They need no chunk or pair bound: a step is never truncated.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native_build, platform
from pallas_kernels.ragged_paged_attention import rounding

HERE = Path(__file__).parent / "native"
KERNELS = {  # kind: (source, handler symbol, FFI target)
    "decode": (HERE / "decode.cc", "VlaxPagedDecode", "vlax_paged_decode"),
    "prefill": (HERE / "prefill.cc", "VlaxPagedPrefill", "vlax_paged_prefill"),
    "write": (HERE / "write.cc", "VlaxPagedWrite", "vlax_paged_write"),
}
DTYPES = (jnp.float32, jnp.bfloat16)
HEAD_DIMS = frozenset(16 * c for c in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))


ATTENTION = ("decode", "prefill")  # built for one head dim each (native/common.h)


def library(kind: str, head_dim: int | None = None) -> Path | None:
    """The `kind` kernel's library (an attention kind's for `head_dim`), built and registered
    once per process (`prepare`)."""
    return prepare(head_dim if kind in ATTENTION else None).get(kind)


def available(head_dim: int) -> bool:
    """Whether every kernel a model of attention head dim `head_dim` uses built here (a bf16
    model then keeps bf16 caches: cpu_bf16.py)."""
    built = prepare(head_dim)
    return head_dim in HEAD_DIMS and all(path is not None for path in built.values())


@cache
def prepare(head_dim: int | None) -> dict[str, Path | None]:
    """The write kernel and, for a head dim in HEAD_DIMS, the attention kernels for it, compiled
    at once (each takes seconds, mostly XLA's FFI headers) and registered: {kind: library, or
    None where it did not build}."""
    kinds = {"write": ()}
    if head_dim in HEAD_DIMS:
        kinds |= {kind: (("VLAX_HEAD_DIM", head_dim),) for kind in ATTENTION}
    with ThreadPoolExecutor(len(kinds)) as pool:
        list(pool.map(_try_build, kinds, kinds.values()))
    return {
        kind: native_build.load(*KERNELS[kind][:2], _target(kind, head_dim), defines)
        for kind, defines in kinds.items()
    }


def _target(kind: str, head_dim: int | None) -> str:
    """The FFI target of `kind`'s kernel: one per head dim for the attention kinds."""
    return f"{KERNELS[kind][2]}_d{head_dim}" if kind in ATTENTION else KERNELS[kind][2]


def _try_build(kind: str, defines) -> None:
    with contextlib.suppress(native_build.BuildError):  # load() says why, once
        native_build.build(KERNELS[kind][0], defines)


def serves(kind: str, q, k_cache) -> bool:
    """Whether the `kind` attention kernel serves a step with these queries and caches, here."""
    head_dim = q.shape[-1]
    return q.dtype in DTYPES and head_dim in HEAD_DIMS and _serves(kind, k_cache, head_dim)


def serves_write(cache) -> bool:
    """Whether the write kernel serves a cache like this one, here."""
    return _serves("write", cache)


def _serves(kind: str, cache, head_dim: int | None = None) -> bool:
    return (
        platform.current_platform() == "cpu"
        and cache.dtype in DTYPES
        and library(kind, head_dim) is not None
    )


def write(cache, rows, slot_mapping):
    """paged_write.write_rows's result, written in place (the output aliases `cache`)."""
    if library("write") is None:
        raise native_build.BuildError("the native write kernel did not build here (logged)")
    call = jax.ffi.ffi_call(
        KERNELS["write"][2],
        jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={0: 0},
    )
    return call(cache, rows.astype(cache.dtype), slot_mapping.astype(jnp.int32))


def decode(
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *, prefix_lens=None, **options
):
    """decode.ragged_paged_decode's result for a step `serves("decode", ...)` accepts (the
    reference's arguments; options: sm_scale, sliding_window, soft_cap). `prefix_lens` changes
    nothing: a row's one query is its last position."""
    del prefix_lens
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    return _attention("decode", *args, None, **options)


def prefill(
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *, prefix_lens=None, **options
):
    """The reference's result for a step of rows of any number of query tokens, each row's the
    last of its context, causal or (`prefix_lens`) a prefix LM's, that `serves("prefill", ...)`
    accepts."""
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    return _attention("prefill", *args, prefix_lens, **options)


def _attention(
    kind,
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    prefix_lens,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    head_dim = q.shape[-1]
    if library(kind, head_dim) is None:
        raise native_build.BuildError(
            f"the native {kind} kernel for head dim {head_dim} did not build here (logged; "
            f"head dims served: {sorted(HEAD_DIMS)})"
        )
    call = jax.ffi.ffi_call(_target(kind, head_dim), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    # A bf16 model's probabilities round as HF's do (rounding.py); its queries are exact in f32.
    round_block = rounding.KEY_BLOCK if rounding.rounds(q.dtype) else 0
    out = call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        # 0: causal (decode reads none: its one query per row is its last position)
        jnp.zeros_like(kv_lens, jnp.int32)
        if prefix_lens is None
        else prefix_lens.astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
        window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        round_block=np.int64(round_block),
    )
    return out.astype(q.dtype)
