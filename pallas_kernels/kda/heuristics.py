"""How many value-dimension slices a KDA kernel runs as separate programs (failure-modes.md §1).

Value columns of the state evolve independently, so a split changes no number; it only adds programs.
It pays when (heads x sequences) programs leave cores idle, and costs when the grid already fills the
device, so the rule depends on heads and sequences only, never on the sequence length.
"""

from __future__ import annotations

MIN_SLICE = 16  # a narrower slice would make dots below the 16-wide minimum


def kda_v_split(num_heads: int, num_seqs: int, v_dim: int, num_cores: int) -> int:
    """Largest power of two s with s * heads * sequences <= cores and v_dim / s >= 16 (at least 1)."""
    for name, val in (("num_heads", num_heads), ("num_seqs", num_seqs), ("v_dim", v_dim)):
        if val < 1:
            raise ValueError(f"kda_v_split: {name} must be >= 1, got {val}")
    split = 1
    while (
        v_dim % (2 * split) == 0
        and v_dim // (2 * split) >= MIN_SLICE
        and 2 * split * num_heads * num_seqs <= num_cores
    ):
        split *= 2
    return split


def check_v_split(v_split: int, v_dim: int) -> str | None:
    """Why `v_split` cannot slice a value dim of `v_dim`, or None when it can."""
    if not isinstance(v_split, int) or v_split < 1 or v_split & (v_split - 1):
        return f"v_split must be a power of two >= 1 or 'auto', got {v_split!r}"
    if v_dim % v_split or v_dim // v_split < MIN_SLICE:
        return f"v_split {v_split} leaves slices of {v_dim}/{v_split}; each must be >= {MIN_SLICE}"
    return None
