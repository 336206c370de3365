"""Rules of the block pool: null block, vLLM's free order, ref counts, hash index, misuse."""

import hashlib

import pytest

from runtime.core.kv import block_pool as bp


def h(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def snapshot(pool: bp.BlockPool) -> tuple:
    blocks = range(1, pool.num_blocks)
    return (
        bp.free_order(pool),
        tuple(bp.ref_count(pool, b) for b in blocks),
        tuple(bp.block_hash_of(pool, b) for b in blocks),
        pool.num_free,
    )


def test_new_pool_hands_out_every_block_but_the_null_block_in_id_order():
    pool = bp.make_block_pool(6, 4)
    assert bp.num_free_blocks(pool) == 5
    assert bp.free_order(pool) == (1, 2, 3, 4, 5)
    pool, taken = bp.take_free_blocks(pool, 5)
    assert taken == (1, 2, 3, 4, 5)
    assert bp.NULL_BLOCK not in taken
    assert bp.num_free_blocks(pool) == 0 and bp.free_order(pool) == ()
    assert all(bp.ref_count(pool, b) == 1 for b in taken)


def test_freed_blocks_without_a_hash_are_reused_first_and_hashed_ones_last():
    """vLLM's BlockPool.free_blocks: a freed block holding no hash (never a prefix hit) goes to
    the FRONT of the free queue, ahead of never-used blocks; one holding a hash to the back. The
    pool used to append every freed block to the back, so under pressure it evicted cached
    prefixes before reusing blocks that could never be hit."""
    pool = bp.make_block_pool(10, 4)
    pool, first = bp.take_free_blocks(pool, 5)
    pool = bp.cache_blocks(pool, first[:2], (h("a"), h("b")))
    pool = bp.release(pool, reversed(first))  # tail-first, as a request frees its table
    assert bp.free_order(pool) == (5, 4, 3, 6, 7, 8, 9, 2, 1)
    pool, again = bp.take_free_blocks(pool, 6)
    assert again == (5, 4, 3, 6, 7, 8)
    assert bp.lookup_cached(pool, h("a")) == 1 and bp.lookup_cached(pool, h("b")) == 2


def test_each_release_puts_its_unhashed_blocks_ahead_of_earlier_ones_in_the_order_given():
    """One call's unhashed blocks keep their given order as a group (vLLM's prepend_n), and a
    later call's group goes in front of it; hashed blocks queue at the back in the order given."""
    pool = bp.make_block_pool(12, 4)
    pool, blocks = bp.take_free_blocks(pool, 8)
    pool = bp.cache_blocks(pool, blocks[4:6], (h("x"), h("y")))
    pool = bp.release(pool, (1, 5, 2))  # 5 is hashed
    pool = bp.release(pool, (3, 6, 4))  # 6 is hashed
    assert bp.free_order(pool) == (3, 4, 1, 2, 9, 10, 11, 5, 6)
    # Reviving the last block ahead of the never-used ones keeps the rest in place.
    pool = bp.touch(pool, [2])
    pool = bp.release(pool, (7,))
    assert bp.free_order(pool) == (7, 3, 4, 1, 9, 10, 11, 5, 6)
    pool = bp.release(pool, (2,))
    assert bp.free_order(pool) == (2, 7, 3, 4, 1, 9, 10, 11, 5, 6)
    pool, taken = bp.take_free_blocks(pool, 7)
    assert taken == (2, 7, 3, 4, 1, 9, 10)
    # With no never-used block left, unhashed blocks still go first, hashed ones last.
    pool = bp.release(pool, (9, 4, 8))
    assert bp.free_order(pool) == (9, 4, 8, 11, 5, 6)


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = bp.make_block_pool(4, 2)
    pool, (block,) = bp.take_free_blocks(pool, 1)
    pool = bp.touch(pool, [block, block])
    assert bp.ref_count(pool, block) == 3
    pool = bp.release(pool, [block, block])
    assert bp.ref_count(pool, block) == 1 and block not in bp.free_order(pool)
    pool = bp.release(pool, [block])
    assert bp.free_order(pool)[0] == block and bp.num_free_blocks(pool) == 3


def test_touch_revives_a_free_cached_block_from_anywhere_in_the_list():
    pool = bp.make_block_pool(6, 2)
    pool, blocks = bp.take_free_blocks(pool, 5)
    pool = bp.set_block_hash(pool, 3, h("three"))
    pool = bp.release(pool, blocks)
    for middle in (3, 1, 5, 2, 4):  # middle, head, tail, then what remains
        order = [b for b in bp.free_order(pool) if b != middle]
        pool = bp.touch(pool, [middle])
        assert bp.free_order(pool) == tuple(order)
        assert bp.ref_count(pool, middle) == 1
    assert bp.lookup_cached(pool, h("three")) == 3
    pool = bp.release(pool, [4, 2])
    assert bp.free_order(pool) == (4, 2)


def test_evicting_a_cached_block_drops_its_hash_and_only_its_hash():
    pool = bp.make_block_pool(4, 2)
    pool, (a, b, _) = bp.take_free_blocks(pool, 3)
    pool = bp.cache_blocks(pool, (a, b), (h("a"), h("b")))
    assert bp.num_cached_blocks(pool) == 2
    pool = bp.release(pool, (b, a))
    assert bp.lookup_cached(pool, h("a")) == a  # a free block stays cached until evicted
    pool, (taken,) = bp.take_free_blocks(pool, 1)
    assert taken == b
    assert bp.lookup_cached(pool, h("b")) is None and bp.block_hash_of(pool, b) is None
    assert bp.lookup_cached(pool, h("a")) == a and bp.num_cached_blocks(pool) == 1


def test_equal_content_in_several_blocks_keeps_a_holder_until_the_last_is_evicted():
    pool = bp.make_block_pool(5, 2)
    pool, blocks = bp.take_free_blocks(pool, 4)
    pool = bp.cache_blocks(pool, blocks[:3], (h("x"),) * 3)
    assert bp.lookup_cached(pool, h("x")) == blocks[0]
    pool = bp.release(pool, (blocks[1], blocks[0], blocks[2]))
    expected_holders = [blocks[0], blocks[2], None]
    for holder in expected_holders:
        pool, _ = bp.take_free_blocks(pool, 1)
        assert bp.lookup_cached(pool, h("x")) == holder
    assert bp.num_cached_blocks(pool) == 0


def test_holders_of_equal_content_are_looked_up_in_registration_order():
    """vLLM keeps the holders of one hash in a dict (registration order) and a lookup returns the
    first. The pool used to link a new holder right after the first, so once the first was
    evicted a lookup found the latest holder instead of the next earliest."""
    pool = bp.make_block_pool(6, 2)
    pool, (x, y, z, other) = bp.take_free_blocks(pool, 4)
    for block in (x, y, z):
        pool = bp.cache_blocks(pool, (block,), (h("same"),))
    pool = bp.cache_blocks(pool, (other,), (h("other"),))
    pool = bp.release(pool, (x, other))
    pool, taken = bp.take_free_blocks(pool, 2)  # the never-used block, then x (evicted)
    assert taken == (5, x)
    assert bp.lookup_cached(pool, h("same")) == y
    pool = bp.release(pool, (y,))
    pool, taken = bp.take_free_blocks(pool, 2)
    assert taken == (other, y) and bp.lookup_cached(pool, h("same")) == z


def test_cached_run_stops_at_the_first_miss_and_the_limit():
    pool = bp.make_block_pool(6, 2)
    pool, blocks = bp.take_free_blocks(pool, 4)
    chain = (h("0"), h("1"), h("2"), h("3"))
    pool = bp.cache_blocks(pool, blocks[:2] + blocks[3:], chain[:2] + chain[3:])
    assert bp.cached_run(pool, chain, 10) == blocks[:2]
    assert bp.cached_run(pool, chain, 1) == blocks[:1]
    assert bp.cached_run(pool, (h("nope"),) + chain, 4) == ()


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda p: bp.release(p, [1, 2, 2]), "ref count 0"),
        (lambda p: bp.release(p, [3]), "ref count 0"),
        (lambda p: bp.release(p, [0]), "null block"),
        (lambda p: bp.touch(p, [1, 7]), "never handed out"),
        (lambda p: bp.touch(p, [1, 9]), "expected an int in 1..7"),
        (lambda p: bp.touch(p, [True]), "expected an int"),
        (lambda p: bp.take_free_blocks(p, 6), "only 5 free"),
        (lambda p: bp.take_free_blocks(p, -1), "expected an int >= 0"),
        (lambda p: bp.set_block_hash(p, 1, b"short"), "32 bytes"),
        (lambda p: bp.set_block_hash(p, 3, h("free")), "is free"),
        (lambda p: bp.set_block_hash(p, 2, h("again")), "already has a hash"),
        (lambda p: bp.cache_blocks(p, (1,), ()), "1 block ids but 0 hashes"),
        (lambda p: bp.cache_blocks(p, (1, 1), (h("a"), h("b"))), "repeated block ids"),
        (lambda p: bp.take_free_blocks(p, 1, (h("a"), h("b"))), "2 hashes for 1 blocks"),
        (lambda p: bp.take_free_blocks(p, 2, (h("a"), b"short")), "32 bytes"),
    ],
)
def test_misuse_raises_and_leaves_the_pool_as_it_was(action, message):
    pool = bp.make_block_pool(8, 2)
    pool, _ = bp.take_free_blocks(pool, 3)
    pool = bp.release(pool, [3])
    pool = bp.set_block_hash(pool, 2, h("two"))
    before = snapshot(pool)
    with pytest.raises(bp.BlockPoolError, match=message):
        action(pool)
    assert snapshot(pool) == before


def test_bad_pool_shapes_are_rejected():
    with pytest.raises(bp.BlockPoolError, match="num_blocks=1"):
        bp.make_block_pool(1, 4)
    with pytest.raises(bp.BlockPoolError, match="block_size=0"):
        bp.make_block_pool(4, 0)


def test_old_pools_are_unchanged_by_later_transitions():
    pool0 = bp.make_block_pool(6, 2)
    pool1, blocks = bp.take_free_blocks(pool0, 3)
    pool2 = bp.cache_blocks(pool1, blocks[:1], (h("a"),))
    pool3 = bp.release(pool2, reversed(blocks))
    branch, _ = bp.take_free_blocks(pool1, 2)  # a second future of pool1
    shots = [snapshot(p) for p in (pool0, pool1, pool2, pool3, branch)]
    pool4, _ = bp.take_free_blocks(pool3, 5)
    for _ in range(2):  # revisit in both directions so re-rooting runs each way
        for p, shot in reversed(
            list(zip((pool0, pool1, pool2, pool3, branch), shots, strict=True))
        ):
            assert snapshot(p) == shot
    assert bp.lookup_cached(pool4, h("a")) is None
    assert bp.lookup_cached(pool3, h("a")) == blocks[0]
    assert snapshot(pool0) == shots[0]


def test_taking_blocks_with_hashes_registers_them_like_cache_blocks():
    """The fused path (evict, hand out, register) leaves the same pool as take, then cache."""
    pool = bp.make_block_pool(6, 2)
    pool, first = bp.take_free_blocks(pool, 5)
    pool = bp.cache_blocks(pool, first, tuple(h(f"old{i}") for i in range(5)))
    pool = bp.release(pool, reversed(first))
    hashes = (h("x"), h("y"), h("old3"))
    fused, taken = bp.take_free_blocks(pool, 4, hashes)
    split, again = bp.take_free_blocks(pool, 4)
    split = bp.cache_blocks(split, again[:3], hashes)
    assert taken == again
    assert snapshot(fused) == snapshot(split)
    assert bp.lookup_cached(fused, h("old3")) == taken[2]
    assert bp.lookup_cached(fused, h("old0")) == bp.lookup_cached(split, h("old0"))
    assert bp.num_cached_blocks(fused) == bp.num_cached_blocks(split)
