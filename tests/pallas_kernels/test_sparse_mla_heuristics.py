"""The split heuristic of sparse MLA decode: bounds, filling the device, collapsing to the fewest."""

from __future__ import annotations

import itertools

import pytest

from pallas_kernels.sparse_mla_decode import heuristics as h


def _waves_iters(T, H, tiles, s, cores):
    base = T * -(-H // h.head_block(H))
    return -(-base * s // cores), -(-tiles // s)


def test_known_choices():
    assert h.num_splits(1, 128, 2048, 132) == 64  # 2 head blocks: one split per tile, one wave
    assert h.num_splits(128, 128, 2048, 132) == 2  # 256 programs already; 2 fill 2x the SMs
    assert h.num_splits(1, 16, 320, 4) == 5  # wants 8; 5 gives the same 2 waves x 2 tiles
    assert h.num_splits(64, 64, 1, 304) == 1  # one tile: never more splits than tiles
    assert h.num_splits(1, 64, 512, 132, extra_topk=128) == 20  # 16 + 4 tiles, split jointly


def test_properties_over_a_grid():
    for T, H, topk, extra, cores in itertools.product(
        (1, 3, 16, 128), (1, 16, 64, 128), (1, 17, 64, 2048), (0, 128), (2, 80, 132, 304)
    ):
        s = h.num_splits(T, H, topk, cores, extra_topk=extra)
        tiles = h.num_tiles(topk, extra)
        assert 1 <= s <= tiles
        base = T * -(-H // h.head_block(H))
        if base >= 2 * cores:
            assert s == 1
        else:
            # Either the device is filled twice over, or every tile has its own split, or the
            # count was collapsed without changing waves or iterations.
            assert base * s >= 2 * cores or s == tiles or s < min(tiles, -(-2 * cores // base))
        chosen = _waves_iters(T, H, tiles, s, cores)
        assert all(_waves_iters(T, H, tiles, x, cores) != chosen for x in range(1, s))


def test_head_block_is_a_power_of_two_in_range():
    for H in (1, 5, 16, 17, 64, 100, 128):
        b = h.head_block(H)
        assert b & (b - 1) == 0 and h.MIN_HEAD_BLOCK <= b <= h.MAX_HEAD_BLOCK


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="topk must be a positive int, got 0"):
        h.num_splits(1, 16, 0, 132)
    with pytest.raises(ValueError, match="num_cores"):
        h.num_splits(1, 16, 8, 0)
