"""What bfloat16 operands are computed in on this host: as they are, or widened to float32.

XLA:CPU on a host without native bf16 (AVX2) computes a bf16 op by widening around it, and
does so slowly. Measured on a loaded 2-core AVX2 host (best of 8-10):
- SiLU * up on [2048, 1408] bf16: 26.8 ms, the same chain written in f32 with the two roundings
  HF makes: 2.9 ms (on 64 rows the same either way). Elementwise chains are always widened.
- the dots of the benchmark Llama's step (8 layers' qkv, o, gate_up, down and the LM head), rows
  x 512 bf16 activations: bf16 dot accumulating in f32 vs both operands widened first:
  64 rows 450 vs 784 ms, 128 rows 1692 vs 1910, 256 rows 2808 vs 2028, 512 rows 3999 vs 3108.
  Widening the weights costs a pass over them per dot, which pays only once enough rows share
  it, so a dot widens from WIDEN_DOT_ROWS rows (prefill), and decode steps keep bf16 dots.
- unless the weights themselves are kept in f32 (`weight_dtype`), widened once at load where the
  host has the memory for it (runtime/runner/cpu_bf16.py): then no dot widens a weight, and a
  decode step's dots are f32 dots. The benchmark Llama's whole offline run, alternating in one
  process: 23.1 against 27.1 s (median of 3), the decode steps and the prefill steps both faster.
Widening changes no value: bf16 x bf16 products are exact in f32, the dots accumulate in f32
either way, and each result is rounded to bf16 where HF's bf16 model rounds it. Where the CPU
has bf16 dots (AVX512-BF16, AMX) nothing is widened (runtime/runner/cpu_bf16.py says why).

The choice is one per process, made by the runner from the CPU's flags before it builds a model
(`widen_bf16`); the layers read it when they are traced, so a process that changes it must trace
its functions again (new jitted functions, or jax.clear_caches()), and the modules read the
weights' dtype when they are built, so a model keeps the one it was built (and loaded) with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_widen = False
_wide_weights = False
_activation_bytes: int | None = None
# The fewest rows a part holds: each part reads the layer's weights again, and at 512 rows a dot
# still does 256 flops per f32 weight byte, compute-bound on any CPU (the benchmark PaliGemma's
# MLP: 33.5 us per row in 512-row parts against 31 in 2048-row ones).
MIN_PART_ROWS = 512
WIDEN_DOT_ROWS = 256  # the fewest rows a widened dot is faster at (module docstring)


def widen_bf16(on: bool, *, weights: bool = False) -> None:
    """Compute bf16 operands in f32 (on) or as bf16 (off) from now on, in this process; with
    `weights` (and on), the models built from now on keep their dense weights in f32."""
    global _widen, _wide_weights
    _widen = bool(on)
    _wide_weights = bool(on and weights)


def widening() -> bool:
    return _widen


def wide_weights() -> bool:
    return _wide_weights


def narrow_attention_dots(dtype) -> bool:
    """Whether a `dtype` model's paged attention takes its dots' operands in bf16 on the jnp path
    (ragged_paged_attention's `narrow_dots`: its keys and values are the model's own bf16
    activations, exact in bf16): for bf16 where this process does not widen, i.e. the host has
    bf16 dots. Measured on a 2-core AMX host, the benchmark Llama's bf16 prefill steps: 512-536
    against 646-665 ms; the whole offline run 14.3-14.9 against 15.4-16.3 s."""
    return jnp.dtype(dtype) == jnp.bfloat16 and not _widen


def limit_activation_bytes(limit: int | None) -> None:
    """From now on in this process, a layer that can compute its rows in parts (the gated MLP)
    keeps each part's widest intermediate under `limit` bytes; None: every row at once. Set by
    the runner on the CPU to the last-level cache size (runtime/runner/host_cache.py says why)."""
    global _activation_bytes
    _activation_bytes = limit


def row_parts(rows: int, row_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) slices of `rows` rows (static), as few and as even as keep `row_bytes` per
    row under the limit (`limit_activation_bytes`), but never under MIN_PART_ROWS; one slice
    where there is no limit or it holds."""
    limit = _activation_bytes
    if limit is None or rows * row_bytes <= limit:
        return [(0, rows)]
    parts = -(-rows * row_bytes // limit)
    size = max(-(-rows // parts), MIN_PART_ROWS)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def weight_dtype(dtype):
    """The dtype a dense weight (Linear, embedding table) of a model computing in `dtype` is kept
    in: f32 for bf16 while this process keeps its weights widened, else `dtype` itself."""
    return jnp.float32 if _wide_weights and jnp.dtype(dtype) == jnp.bfloat16 else dtype


def exact_f32(x: jax.Array) -> jax.Array:
    """bf16 `x` in f32, the same values, through its bits. A plain convert right after a rounding
    to bf16 is a pair XLA's excess-precision pass (on by default) may drop, and the rounding with
    it: a value HF rounds would then enter the next op unrounded."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def in_f32(x: jax.Array) -> jax.Array:
    """`x` as an activation (SiLU, GELU) takes it: in f32, the same values, whatever this
    process widens. torch computes these on bf16 and f16 in f32 and rounds once, where XLA's
    bf16 chain rounds after each of its ops (jax.nn.silu on bf16: 37% of results off by an ulp
    from torch's); in f32 it is also the faster chain on every host (the docstring's timing)."""
    if x.dtype == jnp.bfloat16:
        return exact_f32(x)
    return x.astype(jnp.float32) if x.dtype == jnp.float16 else x


def for_weight(x: jax.Array, weight: jax.Array) -> jax.Array:
    """Activation `x` as a dot with `weight` takes it: bf16 widened exactly where the weight is
    kept in f32 (`weight_dtype`), else as it is."""
    if x.dtype == jnp.bfloat16 and weight.dtype == jnp.float32:
        return exact_f32(x)
    return x


def operand(x: jax.Array) -> jax.Array:
    """`x` as the dots and elementwise chains take it: widened to f32 if it is bf16 and this
    process widens, else unchanged."""
    return exact_f32(x) if _widen and x.dtype == jnp.bfloat16 else x


def dot_operands(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x, w) as a dot of x [..., K] with a weight w takes them: both widened to f32 when this
    process widens and x has at least WIDEN_DOT_ROWS rows (static: known when traced)."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows < WIDEN_DOT_ROWS:
        return x, w
    return operand(x), operand(w)
