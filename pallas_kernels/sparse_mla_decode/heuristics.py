"""Launch shape of the sparse MLA decode kernel: head block, gather tile, warps, split count.

The split count only chooses among paths that the tests force and check equal (within tolerance);
it never changes what is computed.
"""

from __future__ import annotations

# Gathered cache rows per tile. 32 keeps a [64 heads, 32] score tile and four [64, 128] f32 value
# accumulators in registers (the shape of vLLM's gfx950 kernel, failure-modes.md §7).
TILE = 32
MAX_HEAD_BLOCK = 64
MIN_HEAD_BLOCK = 16  # Triton dots need M >= 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def head_block(num_heads: int) -> int:
    """Heads per program: a power of two in [16, 64]; heads are padded up to a multiple of it."""
    return min(MAX_HEAD_BLOCK, max(MIN_HEAD_BLOCK, _next_pow2(num_heads)))


def num_warps(block_h: int) -> int:
    return 8 if block_h >= 64 else 4


def num_tiles(topk: int, extra_topk: int = 0) -> int:
    """Tiles of the index axis; main and extra entries never share a tile."""
    return -(-topk // TILE) + -(-extra_topk // TILE)


def num_splits(T: int, H: int, topk: int, num_cores: int, *, extra_topk: int = 0) -> int:
    """Splits of the index axis: about two programs per core, at most one split per tile, and the
    fewest splits that keep the same number of waves and of tile iterations per split."""
    for name, v in (("T", T), ("H", H), ("topk", topk), ("num_cores", num_cores)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"num_splits: {name} must be a positive int, got {v!r}")
    tiles = num_tiles(topk, extra_topk)
    base = T * -(-H // head_block(H))
    want = max(1, min(tiles, -(-2 * num_cores // base)))
    iters = -(-tiles // want)
    waves = -(-base * want // num_cores)
    # s = want always qualifies, so the search ends there at the latest.
    return next(
        s
        for s in range(1, want + 1)
        if -(-tiles // s) == iters and -(-base * s // num_cores) == waves
    )
