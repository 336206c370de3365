"""Static tiling choices for the Pallas kernel, from the shapes and the device's core count.

None of these changes the result beyond float rounding: every choice is a path the tests force and
compare (split-KV 1 vs several, different query blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.ragged_paged_attention.work_items import (
    pow2_ceil,
    pow2_floor,
    work_item_count,
)

MIN_DOT = 16  # Triton dots need M, N, K >= 16 (kernels.md C.2)
MAX_ROWS = 64  # query rows (tokens x padded group) per program: scores and acc stay in registers
KV_TILE = 64  # keys per inner step
MAX_SPLITS = 16


@dataclass(frozen=True, slots=True)
class Tiling:
    group: int  # q heads per kv head, padded to a power of two
    block_q: int  # query tokens per work item
    pages_per_tile: int
    num_items: int  # static grid size over work items
    num_splits: int

    @property
    def rows(self) -> int:
        return self.block_q * self.group


def query_tiling(num_tokens: int, max_seqs: int, hq: int, hkv: int) -> tuple[int, int]:
    """(padded group, tokens per item): enough rows for a 16-row dot; longer items when the batch
    has many tokens per sequence (prefill), single-token items for decode."""
    group = pow2_ceil(hq // hkv)
    lo = max(1, MIN_DOT // group)
    hi = max(lo, MAX_ROWS // group)
    per_seq = pow2_ceil(-(-num_tokens // max(1, max_seqs)))
    return group, min(max(per_seq, lo), hi)


def choose_splits(programs: int, tiles_per_seq: int, cores: int) -> int:
    """Split the KV walk only when the (item, kv head) grid cannot fill the device twice over, and
    keep at least two KV tiles per split so the combine stays cheap next to the walk."""
    if programs >= 2 * cores or tiles_per_seq < 4:
        return 1
    want = pow2_floor(max(1, (2 * cores) // max(1, programs)))
    return max(1, min(want, pow2_floor(tiles_per_seq // 2), MAX_SPLITS))


def tiling(
    *,
    num_tokens: int,
    max_seqs: int,
    max_blocks: int,
    block_size: int,
    hq: int,
    hkv: int,
    cores: int,
    num_kv_splits: int | str = "auto",
) -> Tiling:
    group, block_q = query_tiling(num_tokens, max_seqs, hq, hkv)
    pages = max(1, max(KV_TILE, MIN_DOT) // block_size)
    items = work_item_count(num_tokens, max_seqs, block_q)
    tiles = -(-max_blocks // pages)
    if num_kv_splits == "auto":
        # Items actually doing work: at most one per sequence in a decode batch.
        busy = min(items, max(max_seqs, -(-num_tokens // block_q)))
        splits = choose_splits(busy * hkv, tiles, cores)
    elif isinstance(num_kv_splits, int) and not isinstance(num_kv_splits, bool):
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1 or 'auto', got {num_kv_splits}")
        splits = num_kv_splits
    else:
        raise ValueError(f"num_kv_splits must be an int >= 1 or 'auto', got {num_kv_splits!r}")
    return Tiling(group, block_q, pages, items, splits)
