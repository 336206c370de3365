"""The model protocol: everything the runner may assume about a model family, and nothing more.

A family is an `nnx.Module` class registered in `model/registry.py` under its HF `architectures`
name. The runner reaches it only through the registry (`registry.model_class`, and `model.loader`,
which builds it) and the members below; it never imports a family's module.

Building (class level; nothing here needs the weights)

  `cls(config: ModelConfig, options: ModelOptions)`
      Builds the modules (parameters only). Every kernel choice the model needs is made here, once,
      by `pallas_kernels.backends` (which logs it with its reason), and kept by the layers that call
      the kernel as static configuration: no backend name travels through the forward calls, and
      the kernel's dispatcher only confirms the choice. `options.attention_backend` forces an
      implementation; one that cannot serve the model raises `BackendError` here, at build time.
  `cls.hf_weight_specs(config) -> tuple[WeightSpec, ...]`
      How every parameter is assembled from the checkpoint's tensors under their on-disk HF names.
  `cls.hf_ignored_weight(name, config) -> bool`
      On-disk tensors that are legitimately unused (rotary buffers, a duplicate tied head).
  `cls.cache_specs(config, options) -> tuple[CacheSpec, ...]`
      What the model keeps for every cached token, one spec per pool (below).

Running (the runner calls these through the pure `forward` / `compute_logits` of this module,
jitted, with the weights as arguments and the caches donated)

  `model(caches, batch: ModelBatch, rows=None) -> (caches, hidden [T, hidden_size])`
      One step over a ragged batch (model/batch.py): writes this step's cache entries through the
      batch's slot mapping and returns the final hidden state of every token. A family may also
      take `rows` (int [R]) and return those rows' alone, [R, hidden_size], its last layer running
      its MLP on them only (the runner's sampling steps: the rows it takes logits of); `forward`
      gathers them from every row's for a family that does not.
  `model.compute_logits(hidden_rows [R, hidden_size]) -> float32 logits [R, vocab_size]`
  `model.backends -> tuple[Choice, ...]`
      The kernel choices made at build time, one per op the model calls, for logs and tests.

Cache specs

  A spec is one pool: what a group of layers keeps, either per cached token (paged) or per running
  request (state slots). Every paged spec shares the request's block table, so one block id means
  the same token range in every pool and the core hands out blocks without knowing what they hold.
  The cache byte budget becomes a block count through the sum of the paged specs' per-block bytes
  (`bytes_per_block`), after the state specs' slots are set aside (`bytes_per_slot`); the runner
  logs each pool and its bytes (`describe`).

  The cache value is a flat tuple with one entry per layer of each spec, in spec order (spec 0's
  layers, then spec 1's, ...), paged and state specs alike; an entry is a tuple of that layer's
  arrays, one per part of its spec. `allocate` builds it and `split_caches` gives a family each
  spec's entries.

  `PagedCacheSpec` covers every paged pool: attention K/V (`paged_kv_spec`: parts k and v, a page of
  [block_size, kv_heads, head_dim]), an MLA latent (one part, one shared head of
  kv_lora_rank + qk_rope_head_dim) and DSA indexer keys (one part of index_head_dim). Its arrays are
  [num_blocks, *page_shape] with the block axis first; the KV offload relies on that: it moves a
  block as its slice of every array.

  `StateCacheSpec` is a recurrent state kept per request, not per token (Kimi-Linear's KDA layers:
  the delta-rule state and the short-convolution tails). Its arrays are [num_slots + 1, *shape], one
  row per state slot. The core (runtime/core) hands a slot to exactly one running request, from its
  admission until it finishes, is aborted or is preempted, and names the slots whose new owner
  starts this step (ModelBatch.state_reset: the model reads zeros for them). Row num_slots is a
  scratch slot, never handed out, which the batch's padding rows read and write. A slot holds no
  token history, so a preempted request rebuilds its state by recompute from token 0, and the
  offload cannot move it (the KV offload refuses models with state specs). `state_specs(specs)` is
  empty for every model without recurrent state.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from model.batch import ModelBatch
from model.weight_spec import WeightSpec

if TYPE_CHECKING:
    from model.config import ModelConfig
    from pallas_kernels.backends import Choice


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """What the runner decides about a model that its checkpoint does not say."""

    block_size: int = 16
    cache_dtype: str | None = None  # None: the model's own dtype
    attention_backend: str = "auto"  # "auto", or the name of an implementation to force
    # enable_expert_parallel: under a mesh, MoE layers split whole experts over the devices
    # instead of each expert's intermediate (model/sharding.py).
    expert_parallel: bool = False
    # Pallas interpret mode of the kernels a family calls, where it passes it on (Kimi-Linear):
    # None follows each choice (interpret mode only where Pallas was forced onto a platform it
    # cannot compile for, e.g. the CPU); False compiles for the GPU even then, which a CPU host
    # can only lower (`.lower(lowering_platforms=("cuda",))`), as the cross-lowering tests do.
    pallas_interpret: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.pallas_interpret not in (None, True, False):
            raise ValueError(
                f"pallas_interpret must be None, True or False, got {self.pallas_interpret!r}"
            )
        if self.cache_dtype is not None:
            _check_dtype_name("cache_dtype", self.cache_dtype)

    def resolve_cache_dtype(self, config: ModelConfig) -> str:
        return config.dtype if self.cache_dtype is None else self.cache_dtype


@dataclass(frozen=True, slots=True)
class PagedCacheSpec:
    """One paged pool: for each of `num_layers` layers, one array per part, [num_blocks, *page_shape]."""

    name: str  # names the pool in logs, e.g. "attention K/V"
    num_layers: int
    parts: tuple[str, ...]  # the arrays each layer keeps, e.g. ("k", "v")
    page_shape: tuple[int, ...]  # one block of one part; page_shape[0] is the block size
    dtype: str

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not self.parts:
            raise ValueError(
                f"cache spec {self.name!r}: needs at least one layer and one part, "
                f"got num_layers={self.num_layers}, parts={self.parts}"
            )
        if not self.page_shape or any(not isinstance(n, int) or n < 1 for n in self.page_shape):
            raise ValueError(
                f"cache spec {self.name!r}: page_shape must be positive ints, got {self.page_shape}"
            )
        _check_dtype_name(f"cache spec {self.name!r}: dtype", self.dtype)

    @property
    def block_size(self) -> int:
        return self.page_shape[0]

    @property
    def bytes_per_block(self) -> int:
        page = math.prod(self.page_shape) * jnp.dtype(self.dtype).itemsize
        return self.num_layers * len(self.parts) * page

    def allocate(self, num_blocks: int) -> tuple[tuple[jax.Array, ...], ...]:
        shape = (num_blocks, *self.page_shape)
        return tuple(
            tuple(jnp.zeros(shape, self.dtype) for _ in self.parts) for _ in range(self.num_layers)
        )

    def describe(self, num_blocks: int) -> str:
        return (
            f"{self.name} {_size(num_blocks * self.bytes_per_block)} ({self.num_layers} "
            f"layer{'s' if self.num_layers > 1 else ''} x "
            f"{'/'.join(self.parts)} {list(self.page_shape)} {self.dtype})"
        )


@dataclass(frozen=True, slots=True)
class StateCacheSpec:
    """Per-request recurrent state: for each of `num_layers` layers, one array per part,
    [num_slots + 1, *shape] (row num_slots is the scratch slot of padding rows)."""

    name: str  # names the pool in logs, e.g. "KDA state"
    num_layers: int
    parts: tuple[str, ...]  # the arrays each layer keeps, e.g. ("recurrent", "conv")
    shapes: tuple[tuple[int, ...], ...]  # one slot of each part, in parts order
    dtypes: tuple[str, ...]  # each part's dtype, in parts order

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not self.parts:
            raise ValueError(
                f"cache spec {self.name!r}: needs at least one layer and one part, "
                f"got num_layers={self.num_layers}, parts={self.parts}"
            )
        if not len(self.shapes) == len(self.dtypes) == len(self.parts):
            raise ValueError(
                f"cache spec {self.name!r}: one shape and one dtype per part; got parts "
                f"{self.parts}, {len(self.shapes)} shapes, {len(self.dtypes)} dtypes"
            )
        for part, shape, dtype in zip(self.parts, self.shapes, self.dtypes, strict=True):
            if not isinstance(shape, tuple) or any(not isinstance(n, int) or n < 1 for n in shape):
                raise ValueError(
                    f"cache spec {self.name!r}: part {part!r} shape must be a tuple of positive "
                    f"ints, got {shape!r}"
                )
            _check_dtype_name(f"cache spec {self.name!r}: part {part!r} dtype", dtype)

    @property
    def bytes_per_slot(self) -> int:
        one = sum(
            math.prod(shape) * jnp.dtype(dtype).itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
        return self.num_layers * one

    def allocate(self, num_slots: int) -> tuple[tuple[jax.Array, ...], ...]:
        """num_slots + 1 zeroed rows per array: the last is the padding rows' scratch slot."""
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"cache spec {self.name!r}: num_slots must be >= 0, got {num_slots!r}")
        return tuple(
            tuple(
                jnp.zeros((num_slots + 1, *shape), dtype)
                for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
            )
            for _ in range(self.num_layers)
        )

    def describe(self, num_slots: int) -> str:
        parts = ", ".join(
            f"{p} {list(sh)} {dt}"
            for p, sh, dt in zip(self.parts, self.shapes, self.dtypes, strict=True)
        )
        return (
            f"{self.name} {_size((num_slots + 1) * self.bytes_per_slot)} ({num_slots} slots + 1 "
            f"scratch of {self.bytes_per_slot} bytes; {self.num_layers} "
            f"layer{'s' if self.num_layers > 1 else ''} x {parts})"
        )


CacheSpec = PagedCacheSpec | StateCacheSpec


def paged_kv_spec(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    name: str = "attention K/V",
) -> PagedCacheSpec:
    """Paged attention keys and values: a page of [block_size, num_kv_heads, head_dim] each."""
    return PagedCacheSpec(name, num_layers, ("k", "v"), (block_size, num_kv_heads, head_dim), dtype)


def paged_specs(specs: Sequence[CacheSpec]) -> tuple[PagedCacheSpec, ...]:
    return tuple(s for s in specs if isinstance(s, PagedCacheSpec))


def state_specs(specs: Sequence[CacheSpec]) -> tuple[StateCacheSpec, ...]:
    """The specs kept per request (recurrent state); empty for a model without any."""
    return tuple(s for s in specs if isinstance(s, StateCacheSpec))


def has_state(specs: Sequence[CacheSpec]) -> bool:
    return any(isinstance(s, StateCacheSpec) for s in specs)


def bytes_per_block(specs: Sequence[CacheSpec]) -> int:
    """One block id's bytes over every paged pool: the unit a cache byte budget is divided by."""
    paged = paged_specs(specs)
    if not paged:
        raise ValueError(
            "a model declares at least one cache spec that is paged, got "
            + (", ".join(s.name for s in specs) or "none")
        )
    sizes = {s.block_size for s in paged}
    if len(sizes) != 1:
        raise ValueError(
            "every paged cache spec shares the block table, so they need one block size; got "
            + ", ".join(f"{s.name}: {s.block_size}" for s in paged)
        )
    return sum(s.bytes_per_block for s in paged)


def bytes_per_slot(specs: Sequence[CacheSpec]) -> int:
    """One state slot's bytes over every state pool (0 for a model without recurrent state)."""
    return sum(s.bytes_per_slot for s in state_specs(specs))


def allocate(specs: Sequence[CacheSpec], num_blocks: int, num_slots: int = 0) -> tuple:
    """The zeroed cache value: one entry per layer of each spec, in spec order (state pools get
    num_slots + 1 rows, the last the padding rows' scratch slot)."""
    return tuple(
        entry
        for spec in specs
        for entry in spec.allocate(num_slots if isinstance(spec, StateCacheSpec) else num_blocks)
    )


def split_caches(specs: Sequence[CacheSpec], caches: tuple) -> tuple[tuple, ...]:
    """Each spec's entries of the flat cache value, in spec order."""
    want = sum(s.num_layers for s in specs)
    if len(caches) != want:
        raise ValueError(
            f"got {len(caches)} cache entries for {want} layers over the specs "
            + ", ".join(f"{s.name} ({s.num_layers})" for s in specs)
        )
    out, start = [], 0
    for spec in specs:
        out.append(tuple(caches[start : start + spec.num_layers]))
        start += spec.num_layers
    return tuple(out)


def describe(specs: Sequence[CacheSpec], num_blocks: int, num_slots: int = 0) -> str:
    """The cache in one line: its blocks (and state slots), total bytes, and each pool's bytes."""
    total = num_blocks * bytes_per_block(specs)  # checks there is a paged spec
    paged = paged_specs(specs)
    pools = [s.describe(num_blocks) for s in paged]
    line = f"{num_blocks} blocks of {paged[0].block_size} tokens"
    states = state_specs(specs)
    if states:
        total += (num_slots + 1) * bytes_per_slot(specs)
        pools += [s.describe(num_slots) for s in states]
        line += f" and {num_slots} state slots of {bytes_per_slot(specs)} bytes"
    return f"{line}, {_size(total)}: " + "; ".join(pools)


class ModelFamily(Protocol):
    """The members documented above, for type checkers; families do not inherit from it."""

    backends: tuple[Choice, ...]

    def __init__(self, config: ModelConfig, options: ModelOptions) -> None: ...

    @classmethod
    def hf_weight_specs(cls, config: ModelConfig) -> tuple[WeightSpec, ...]: ...

    @staticmethod
    def hf_ignored_weight(name: str, config: ModelConfig) -> bool: ...

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple[CacheSpec, ...]: ...

    def __call__(
        self, caches: tuple, batch: ModelBatch, rows: jax.Array | None = None
    ) -> tuple[tuple, jax.Array]: ...

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array: ...


def forward(
    graphdef, state, caches: tuple, batch: ModelBatch, rows: jax.Array | None = None
) -> tuple[tuple, jax.Array]:
    """(caches, hidden [T, hidden_size]) of any family; pure, for jit with the caches donated.
    `rows`: the final hidden state of these rows only, [len(rows), hidden_size] (a family that
    takes `rows` then runs its last layer's MLP on them alone; every layer still writes the
    caches of every token)."""
    model = nnx.merge(graphdef, state)
    if rows is None:
        return model(caches, batch)
    if _takes_rows(type(model)):
        return model(caches, batch, rows=rows)
    caches, hidden = model(caches, batch)
    return caches, hidden[rows]


@functools.cache
def _takes_rows(family: type) -> bool:
    return "rows" in inspect.signature(family.__call__).parameters


def compute_logits(graphdef, state, hidden_rows: jax.Array) -> jax.Array:
    """float32 logits [R, vocab] of any family for the selected hidden rows."""
    return nnx.merge(graphdef, state).compute_logits(hidden_rows)


def _check_dtype_name(what: str, dtype) -> None:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name != dtype:
        raise ValueError(f"{what} must be a dtype name such as 'float32', got {dtype!r}")


def _size(nbytes: int) -> str:
    """Exact bytes, and a readable size beside them."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes} bytes ({nbytes / scale:.1f} {unit})"
    return f"{nbytes} bytes"
