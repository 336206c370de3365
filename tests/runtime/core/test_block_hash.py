"""Block hashes: stable across processes, chained, and keyed by every extra key where it applies."""

import os
import subprocess
import sys

import pytest

from runtime.core.kv.block_hash import HashExtras, extend_block_hashes

TOKENS = list(range(100, 112))  # three blocks of 4


def test_only_full_blocks_are_hashed_and_extending_matches_hashing_at_once():
    whole = extend_block_hashes((), TOKENS + [1, 2], 4)
    assert len(whole) == 3 and len(set(whole)) == 3
    assert all(isinstance(x, bytes) and len(x) == 32 for x in whole)
    part = extend_block_hashes((), TOKENS[:5], 4)
    assert extend_block_hashes(part, TOKENS, 4) == whole
    assert extend_block_hashes(whole, TOKENS + [1, 2], 4) == whole


def test_hash_chains_the_parent():
    a = extend_block_hashes((), [9, 9, 9, 9] + TOKENS[4:8], 4)
    b = extend_block_hashes((), TOKENS[:8], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parents


def test_hash_is_stable_across_processes_with_different_hash_seeds():
    code = (
        "from runtime.core.kv.block_hash import HashExtras, extend_block_hashes as e;"
        "x = HashExtras(mm_spans=(('img', 2, 3),), lora_name='l', cache_salt='s');"
        f"print(e((), {TOKENS}, 4, x)[-1].hex())"
    )
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    local = HashExtras(mm_spans=(("img", 2, 3),), lora_name="l", cache_salt="s")
    assert digests == {extend_block_hashes((), TOKENS, 4, local)[-1].hex()}


def test_extra_keys_apply_to_the_blocks_they_should():
    plain = extend_block_hashes((), TOKENS, 4)
    salted = extend_block_hashes((), TOKENS, 4, HashExtras(cache_salt="s"))
    assert salted[0] != plain[0]  # the salt only keys the first block (the rest follow by chaining)
    salted_later = extend_block_hashes(plain[:1], TOKENS, 4, HashExtras(cache_salt="s"))
    assert salted_later == plain
    lora = extend_block_hashes(plain[:1], TOKENS, 4, HashExtras(lora_name="a"))
    assert lora[1] != plain[1] and lora[2] != plain[2]
    # A span over tokens 5..6 keys block 1 only: block 2's hash differs only through its parent.
    image = HashExtras(mm_spans=(("img", 5, 2),))
    with_image = extend_block_hashes(plain[:1], TOKENS, 4, image)
    assert with_image[1] != plain[1]
    assert extend_block_hashes(plain[:2], TOKENS, 4, image) == plain
    other_image = extend_block_hashes(plain[:1], TOKENS, 4, HashExtras(mm_spans=(("b", 5, 2),)))
    moved_image = extend_block_hashes(plain[:1], TOKENS, 4, HashExtras(mm_spans=(("img", 6, 1),)))
    assert len({with_image[1], other_image[1], moved_image[1]}) == 3
    # A span crossing a block boundary keys both blocks.
    across = extend_block_hashes(plain[:1], TOKENS, 4, HashExtras(mm_spans=(("img", 7, 2),)))
    assert across[1] != plain[1] and across[2] != extend_block_hashes(across[:2], TOKENS, 4)[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mm_spans": (("a", 4, 2), ("b", 5, 1))}, "non-overlapping"),
        ({"mm_spans": (("a", -1, 2),)}, "offset: int >= 0"),
        ({"mm_spans": (("a", 1, 0),)}, "length: int >= 1"),
        ({"mm_spans": [("a", 1, 1)]}, "expected a tuple"),
        ({"lora_name": 3}, "lora_name=3"),
        ({"cache_salt": b"x"}, "cache_salt=b'x'"),
    ],
)
def test_bad_extras_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HashExtras(**kwargs)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="64-bit ints"):
        extend_block_hashes((), [1, 2, 3, 2**70], 4)
    with pytest.raises(ValueError, match="hold only 0 full blocks"):
        extend_block_hashes((b"x" * 32,), [1, 2], 4)
    with pytest.raises(ValueError, match="block_size=0"):
        extend_block_hashes((), [1], 0)
