"""One registry for every op in pallas_kernels: which implementation serves a call, and why.

Each implementation declares what it can serve. `select` checks the *full* set of arguments the caller
will pass (platform, dtype, head dim, features), picks the best eligible implementation, records why
every better one was rejected, and logs the decision with its reason (INFO). A forced implementation
that cannot serve the query raises at once, so a misconfiguration fails when the engine is configured,
not inside a jitted step.

A model decides once, when it is built, and hands the `Choice` to each layer; the op's dispatcher is
then called with that `Choice` as its `impl` and only confirms that it serves the call (raising if
not), so nothing is decided, or logged, again at trace time. A dispatcher called with a string
("auto" or an implementation's name) decides there, for direct calls of the op.
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
    """The implementation that serves an op, decided once; hashable, so a layer can keep it as
    static configuration."""

    op: str
    impl: str
    fn: Callable
    interpret: bool
    rejected: tuple[tuple[str, str], ...]  # (better implementation, why it cannot serve)
    forced: bool  # named by configuration rather than picked by priority
    implementation: Implementation  # what it serves, to confirm the choice at each call

    def describe(self) -> str:
        mode = " (interpret mode)" if self.interpret else ""
        if self.forced:
            why = "forced by configuration"
        elif self.rejected:
            why = "rejected " + "; ".join(f"{n}: {r}" for n, r in self.rejected)
        else:
            why = "the preferred implementation"
        return f"{self.op} -> {self.impl}{mode} [{why}]"


_REGISTRY: dict[str, dict[str, Implementation]] = {}


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
    impl: str | Choice = "auto",
    platform: str | None = None,
    dtype=None,
    head_dim: int | None = None,
    features=(),
    **extra,
) -> Choice:
    """The implementation of `op` for a call described by the arguments.

    `impl="auto"` takes the highest-priority eligible implementation; an implementation's name forces
    that one and raises `BackendError` naming the reason when it cannot serve the query. Either way the
    decision is logged once, here. A `Choice` made earlier is confirmed instead: returned as it is if
    its implementation serves this call, `BackendError` otherwise; nothing is decided or logged.
    """
    q = Query(
        platform=platform or default_platform(),
        dtype=None if dtype is None else jax.numpy.dtype(dtype).name,
        head_dim=head_dim,
        features=frozenset(features),
        extra=extra,
    )
    if isinstance(impl, Choice):
        return _confirm(op, impl, q)
    choice = _decide(op, impl, q)
    log.info("backend: %s", choice.describe())
    return choice


def _decide(op: str, impl: str, q: Query) -> Choice:
    impls = implementations(op)
    if impl != "auto":
        if impl not in impls:
            raise BackendError(f"{op}: unknown implementation {impl!r}; known: {sorted(impls)}")
        chosen = impls[impl]
        reason = chosen.rejection(q, forced=True)
        if reason is not None:
            raise BackendError(f"{op}: implementation {impl!r} cannot serve this call: {reason}")
        interpret = q.platform not in chosen.platforms
        return Choice(op, impl, chosen.fn, interpret, (), True, chosen)

    rejected = []
    for cand in sorted(impls.values(), key=lambda i: -i.priority):
        reason = cand.rejection(q, forced=False)
        if reason is None:
            return Choice(op, cand.name, cand.fn, False, tuple(rejected), False, cand)
        rejected.append((cand.name, reason))
    why = "; ".join(f"{n}: {r}" for n, r in rejected)
    raise BackendError(f"{op}: no implementation serves this call ({why})")


def _confirm(op: str, choice: Choice, q: Query) -> Choice:
    if choice.op != op:
        raise BackendError(f"{op}: given the choice made for another op ({choice.describe()})")
    # A choice that runs natively must still be on one of its native platforms; one forced into
    # interpret mode may stay there.
    reason = choice.implementation.rejection(q, forced=choice.interpret)
    if reason is not None:
        raise BackendError(
            f"{op}: implementation {choice.impl!r}, chosen when the model was built, cannot serve "
            f"this call: {reason}"
        )
    return choice
