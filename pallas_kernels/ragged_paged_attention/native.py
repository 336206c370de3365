"""Attention on the CPU read in place from the paged cache: C++ kernels (native/*.cc).

On the jnp path XLA:CPU cannot read the cache through the block tables inside a dot or a
reduction: each layer first copies the pages it attends (decode.py gathers every live page of K
and V; tiles.py each (tile, chunk) pair's), and its small batched dots run on one core. These
kernels read each sequence's keys and values where they lie and split the work over XLA's
intra-op threads. Measured per layer on a 2-core Xeon (AVX-512, f32, 8 query and 2 kv heads of
64, median of 21):
- decode (native/decode.cc), 64 sequences, contexts 100..600: decode.py 5.9 ms, 2.2 here (3.6 on
  one thread). Each sequence is a work item: its heads' scores, a two-pass softmax, the value
  sum with each head's accumulators in registers.
- every other causal step (native/prefill.cc), 2048 tokens of 11 rows (prompts of 39..441
  tokens and a 200-token chunk continuing a 400-token context): tiles.py 35.3 ms, 8.8 here.
  A work item is a tile of one sequence's tokens and one kv head; its rows score 16 keys at a
  time against a transposed copy of them, then sum the values four rows at a time.

They serve f32 caches with f32 or bf16 queries (a bf16 model's probabilities rounded to bf16
relative to the running maximum over HF's key blocks, as rounding.py says), head dims in
`HEAD_DIMS`, on the CPU where the library builds (pallas_kernels/native_build.py; otherwise it logs
why, once, and the jnp path serves). Results are the reference's within f32 rounding (other
summation order, their own exp; a bf16 output may differ by one ulp), with its rules: keys a query
does not attend are never read, an attended non-finite value row makes the heads reading it NaN
(masked_values.py), and a step the kernel does not serve (decode: a row with more than one query
token; prefill: more query tokens than context) is all NaN. They need no chunk or pair bound: a
step is never truncated.
"""

from __future__ import annotations

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
}
HEAD_DIMS = frozenset(16 * c for c in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))


def library(kind: str) -> Path | None:
    """The `kind` kernel's library, built and registered once per process (native_build.load)."""
    return native_build.load(*KERNELS[kind])


def serves(kind: str, q, k_cache) -> bool:
    """Whether the `kind` kernel serves a step with these queries and caches, here."""
    return (
        platform.current_platform() == "cpu"
        and q.dtype in (jnp.float32, jnp.bfloat16)
        and k_cache.dtype == jnp.float32
        and q.shape[-1] in HEAD_DIMS
        and library(kind) is not None
    )


def _attention(kind, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, **options):
    if library(kind) is None:
        raise native_build.BuildError(f"the native {kind} kernel did not build here (logged)")
    call = jax.ffi.ffi_call(KERNELS[kind][2], jax.ShapeDtypeStruct(q.shape, jnp.float32))
    sliding_window, soft_cap = options["sliding_window"], options["soft_cap"]
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
        sm_scale=np.float32(options["sm_scale"]),
        window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        round_block=np.int64(round_block),
    )
    return out.astype(q.dtype)


def decode(
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *, prefix_lens=None, **options
):
    """decode.ragged_paged_decode's result for a step `serves("decode", ...)` accepts (the
    reference's arguments; options: sm_scale, sliding_window, soft_cap). `prefix_lens` changes
    nothing: a row's one query is its last position."""
    del prefix_lens
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    return _attention("decode", *args, **_options(**options))


def prefill(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, **options):
    """The reference's result for a causal step (rows of any number of query tokens, each
    row's the last of its context) that `serves("prefill", ...)` accepts."""
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    return _attention("prefill", *args, **_options(**options))


def _options(*, sm_scale: float, sliding_window=None, soft_cap=None):
    return dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
