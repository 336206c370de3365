"""How one model parameter is assembled from tensors stored on disk under their HF names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightSpec:
    path: tuple  # the parameter's path in the model's nnx state
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (HF tensor name, expected shape on disk)
    # HF stores linear weights [out, in]; our kernels are [in, out]. Several sources are joined
    # along the output axis (fused q/k/v and gate/up projections).
    transpose: bool = False
