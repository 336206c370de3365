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
    # When > 0, the sources are this many equal consecutive runs, each joined as above into one
    # entry of a new leading axis: MoE experts, stored one tensor per expert on disk, kept stacked.
    stacked: int = 0

    def __post_init__(self):
        if self.stacked < 0 or (self.stacked and len(self.sources) % self.stacked):
            raise ValueError(
                f"WeightSpec {self.path}: {len(self.sources)} sources cannot be stacked "
                f"{self.stacked} ways"
            )
