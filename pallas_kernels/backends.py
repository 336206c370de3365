"""One registry for every op in pallas_kernels: which implementation serves a call, and why.

Each implementation declares what it can serve. `select` checks the *full* set of arguments the caller
will pass (platform, dtype, head dim, features), picks the best eligible implementation, and records why
every better one was rejected. A forced implementation that cannot serve the query raises at once, so a
misconfiguration fails when the engine is configured, not inside a jitted step.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jax

from pallas_kernels.platform import current_platform

log = logging.getLogger(__name__)

# Ops register themselves when their package is imported; `select` imports these first.
_OP_MODULES = (
    "pallas_kernels.ragged_paged_attention",
    "pallas_kernels.flash_attention",
    "pallas_kernels.sparse_mla_decode",
    "pallas_kernels.kda",
)

GPU_PLATFORMS = frozenset({"cuda", "rocm"})


class BackendError(ValueError):
    """A forced implementation cannot serve the query, or the op/impl is unknown."""


@dataclass(frozen=True, slots=True)
class Query:
    """Everything about a call that can make an implementation ineligible."""

    platform: str
    dtype: str | None = None
    head_dim: int | None = None
    features: frozenset[str] = frozenset()
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Implementation:
    """What one implementation of an op serves.

    `platforms` are where it runs natively; `interpret_platforms` are where it can run only in Pallas
    interpret mode, which is never chosen automatically (it is for tests and debugging). `check` covers
    op-specific limits and returns a reason string when the query is not served.
    """

    op: str
    name: str
    fn: Callable
    priority: int
    platforms: frozenset[str]
    interpret_platforms: frozenset[str] = frozenset()
    dtypes: frozenset[str] | None = None
    head_dims: frozenset[int] | None = None
    features: frozenset[str] = frozenset()
    check: Callable[[Query], str | None] | None = None

    def rejection(self, q: Query, *, forced: bool) -> str | None:
        runs_here = q.platform in self.platforms or (
            forced and q.platform in self.interpret_platforms
        )
        if not runs_here:
            where = sorted(self.platforms | (self.interpret_platforms if forced else frozenset()))
            return f"platform {q.platform!r} not served (serves {where})"
        if self.dtypes is not None and q.dtype is not None and q.dtype not in self.dtypes:
            return f"dtype {q.dtype} not served (serves {sorted(self.dtypes)})"
        if (
            self.head_dims is not None
            and q.head_dim is not None
            and q.head_dim not in self.head_dims
        ):
            return f"head_dim {q.head_dim} not served (serves {sorted(self.head_dims)})"
        missing = q.features - self.features
        if missing:
            return f"features {sorted(missing)} not served (serves {sorted(self.features)})"
        return self.check(q) if self.check is not None else None


@dataclass(frozen=True, slots=True)
class Choice:
    op: str
    impl: str
    fn: Callable
    interpret: bool
    rejected: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        mode = " (interpret mode)" if self.interpret else ""
        why = "; ".join(f"{n}: {r}" for n, r in self.rejected)
        return f"{self.op} -> {self.impl}{mode}" + (f" [rejected {why}]" if why else "")


_REGISTRY: dict[str, dict[str, Implementation]] = {}
_LOGGED: set[str] = set()


def register(impl: Implementation) -> Implementation:
    _REGISTRY.setdefault(impl.op, {})[impl.name] = impl
    return impl


def _ensure_registered() -> None:
    for name in _OP_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def implementations(op: str) -> dict[str, Implementation]:
    _ensure_registered()
    if op not in _REGISTRY:
        raise BackendError(f"unknown op {op!r}; registered ops: {sorted(_REGISTRY)}")
    return dict(_REGISTRY[op])


def default_platform() -> str:
    return current_platform()


def select(
    op: str,
    *,
    impl: str = "auto",
    platform: str | None = None,
    dtype=None,
    head_dim: int | None = None,
    features=(),
    **extra,
) -> Choice:
    """Pick the implementation of `op` for a call described by the arguments.

    `impl="auto"` takes the highest-priority eligible implementation; any other value forces that one and
    raises `BackendError` naming the reason when it cannot serve the query.
    """
    impls = implementations(op)
    q = Query(
        platform=platform or default_platform(),
        dtype=None if dtype is None else jax.numpy.dtype(dtype).name,
        head_dim=head_dim,
        features=frozenset(features),
        extra=extra,
    )
    if impl != "auto":
        if impl not in impls:
            raise BackendError(f"{op}: unknown implementation {impl!r}; known: {sorted(impls)}")
        chosen = impls[impl]
        reason = chosen.rejection(q, forced=True)
        if reason is not None:
            raise BackendError(f"{op}: implementation {impl!r} cannot serve this call: {reason}")
        return Choice(op, impl, chosen.fn, q.platform not in chosen.platforms, ())

    rejected = []
    for cand in sorted(impls.values(), key=lambda i: -i.priority):
        reason = cand.rejection(q, forced=False)
        if reason is None:
            choice = Choice(op, cand.name, cand.fn, False, tuple(rejected))
            if rejected and choice.describe() not in _LOGGED:
                _LOGGED.add(choice.describe())
                log.info("backend fallback: %s", choice.describe())
            return choice
        rejected.append((cand.name, reason))
    why = "; ".join(f"{n}: {r}" for n, r in rejected)
    raise BackendError(f"{op}: no implementation serves this call ({why})")
