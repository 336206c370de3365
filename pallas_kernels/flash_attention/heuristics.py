"""Block sizes for the flash kernel: powers of two, at least 16 (Triton dot minimum), at most 64 so a
[64, 64] f32 score tile and a [64, D] accumulator fit a 4-warp program's registers."""

from __future__ import annotations

MIN_BLOCK = 16
MAX_BLOCK = 64


def block_sizes(seq_len: int) -> tuple[int, int]:
    b = 1 << max(0, (max(seq_len, 1) - 1).bit_length())
    b = min(max(b, MIN_BLOCK), MAX_BLOCK)
    return b, b
