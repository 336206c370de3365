"""Golden block-hash values. Stored KV (host store, Mooncake) is keyed by these hashes, so a change
to their encoding silently turns every stored block into a miss, or worse, into a hit on other
content: any change here must come with a new `_MAGIC` version, never by editing the digests."""

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from runtime.core.kv.block_hash import HashExtras, extend_block_hashes

# name: (token ids, block size, HashExtras keyword arguments)
CHAINS = {
    "plain": (list(range(100, 112)), 4, {}),
    # a partial last block (not hashed), ids beyond 32 bits, negative and the int64 maximum
    "partial_tail_and_wide_ids": ([0, 1, 2**40, -5, 7, 127, 2**63 - 1, 3, 9], 4, {}),
    # img-a crosses the 0|1 boundary; img-b fills block 2 exactly (starts at its start, ends at
    # its end); img-c starts exactly at block 3's start
    "mm_spans": (
        list(range(100, 116)),
        4,
        {"mm_spans": [["img-a", 2, 3], ["img-b", 8, 4], ["img-c", 12, 1]]},
    ),
    "lora_and_salt": (
        list(range(100, 112)),
        4,
        {"lora_name": "adapter-1", "cache_salt": "tenant-é"},
    ),
    "all_extras_block_16": (
        list(range(40)),
        16,
        {"mm_spans": [["9f86d081", 10, 12]], "lora_name": "l", "cache_salt": "s"},
    ),
}

GOLDEN = {
    "plain": [
        "9b8c979eec65e5c4d7e74e439db753c8b20394826cd12f506094551dfdc7e77a",
        "92a7da704128c9f7410bc27394476216b99cbcbd0eae252320bf0ea7aba4bd1a",
        "9d351cc8e625c4127fd057092625b48f1387528e6581e2d884c23705ae9a978d",
    ],
    "partial_tail_and_wide_ids": [
        "9e04412f08a7156de167d7d3c6d045168b8f980b77f70361af4869ed8bb3eab7",
        "f8325081dc3966e1d8dfd33fcc564186b84bf57545d4b44c3a313e38c09ba461",
    ],
    "mm_spans": [
        "7225c399d6120f617bd2f9aa096559cd50d6faa3f7031a1ed67e40f6cc256521",
        "f4f12fe346f1b7d649e7723ebbfad33e2fd65b62c33927a96901eaaeca0e51a6",
        "4226f69e5ffd607a5a47fdfdd702084188c4ae888ab8bbb511c017d7e6ef680a",
        "d6c415235c21593ccf52cec5ed3dd7d6d0f1ed7b86fe4602ae0848a743a19ae7",
    ],
    "lora_and_salt": [
        "4e826136c4028c118989cb70d6bb3ec3258a281c1ccc2599f856229b4baf2fca",
        "27f28c6ba66688e3f5d9e6b8494458d4f6ebd364a1a03c6748d845000a113793",
        "e9ab70b0d7a15f40d5148a7a0c9d0b75498f188c0e70e043796c93190cc99b05",
    ],
    "all_extras_block_16": [
        "0b4e0bce78fa0cf0bd60b05975db1ec3fc8d59c3a9d1668b88bb6960dde64e85",
        "f4fac2eaa99ec53c8e0d614aa4eb374b1b2ebcf601e9d18e36c0631cc30a5c79",
    ],
}

_HEX_CHAINS = """
import json, sys
from runtime.core.kv.block_hash import HashExtras, extend_block_hashes
out = {}
for name, (tokens, block_size, extras) in json.load(sys.stdin).items():
    if "mm_spans" in extras:
        extras["mm_spans"] = tuple(tuple(s) for s in extras["mm_spans"])
    out[name] = [h.hex() for h in extend_block_hashes((), tokens, block_size, HashExtras(**extras))]
print(json.dumps(out))
"""


def _hex_chain(name: str) -> list[str]:
    tokens, block_size, extras = CHAINS[name]
    extras = dict(extras)
    if "mm_spans" in extras:
        extras["mm_spans"] = tuple(tuple(s) for s in extras["mm_spans"])
    return [h.hex() for h in extend_block_hashes((), tokens, block_size, HashExtras(**extras))]


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chains_hash_to_their_golden_digests(name):
    assert _hex_chain(name) == GOLDEN[name]


def test_fresh_processes_with_other_hash_seeds_give_the_golden_digests():
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _HEX_CHAINS],
            input=json.dumps(CHAINS),
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == GOLDEN, f"PYTHONHASHSEED={seed}"


def _spec_hash(parent: bytes, tokens, block_size, mm=(), lora=None, salt=None) -> str:
    """The documented encoding, written out: sha256 over magic, parent (length-prefixed), block
    size, the tokens as int64 little-endian, each overlapping span's (tag, hash, offset), the LoRA
    name, and the cache salt (first block only)."""

    def text(tag: bytes, value: str | None) -> bytes:
        if value is None:
            return b""
        raw = value.encode()
        return tag + struct.pack("<I", len(raw)) + raw

    body = b"vlax.block.v1\x00" + bytes([len(parent)]) + parent
    body += struct.pack("<I", block_size) + struct.pack(f"<{block_size}q", *tokens)
    for mm_hash, offset in mm:
        body += text(b"m", mm_hash) + struct.pack("<q", offset)
    body += text(b"l", lora) + text(b"s", salt)
    return hashlib.sha256(body).hexdigest()


def test_golden_digests_follow_the_documented_encoding():
    tokens = CHAINS["mm_spans"][0]
    b0 = _spec_hash(b"", tokens[0:4], 4, mm=[("img-a", 2)])
    b1 = _spec_hash(bytes.fromhex(b0), tokens[4:8], 4, mm=[("img-a", 2)])
    # img-b ends exactly where block 3 starts: it keys block 2 only.
    b2 = _spec_hash(bytes.fromhex(b1), tokens[8:12], 4, mm=[("img-b", 8)])
    b3 = _spec_hash(bytes.fromhex(b2), tokens[12:16], 4, mm=[("img-c", 12)])
    assert [b0, b1, b2, b3] == GOLDEN["mm_spans"]
    tokens = CHAINS["lora_and_salt"][0]
    s0 = _spec_hash(b"", tokens[0:4], 4, lora="adapter-1", salt="tenant-é")
    s1 = _spec_hash(bytes.fromhex(s0), tokens[4:8], 4, lora="adapter-1")
    assert [s0, s1] == GOLDEN["lora_and_salt"][:2]
