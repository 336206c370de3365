"""Stable prefix-cache hashes of full KV blocks.

A block's hash is the sha256 of a canonical byte encoding of (parent hash, the block's token ids,
its extra keys). Python's `hash()` is salted per process, so it is never used: hashes must agree
across processes and runs (KV stores outlive engines).
"""

import hashlib
import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.core.kv.block_pool import BlockHash

_MAGIC = b"vlax.block.v1\x00"
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


@dataclass(frozen=True, slots=True)
class HashExtras:
    """Extra keys that make equal token ids hash differently.

    mm_spans: (multimodal content hash, placeholder offset, length in tokens), sorted by offset and
    non-overlapping (placeholders of one prompt never overlap).
    """

    mm_spans: tuple[tuple[str, int, int], ...] = ()
    lora_name: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mm_spans, tuple):
            raise ValueError(f"mm_spans={self.mm_spans!r}: expected a tuple of (hash, offset, len)")
        end = 0
        for span in self.mm_spans:
            if not (
                isinstance(span, tuple)
                and len(span) == 3
                and isinstance(span[0], str)
                and _is_int(span[1])
                and _is_int(span[2])
                and span[1] >= 0
                and span[2] >= 1
            ):
                raise ValueError(
                    f"mm span {span!r}: expected (content hash: str, offset: int >= 0, "
                    "length: int >= 1)"
                )
            if span[1] < end:
                raise ValueError(
                    f"mm span {span!r} starts before the previous span ends at {end}: "
                    "expected spans sorted by offset and non-overlapping"
                )
            end = span[1] + span[2]
        for name in ("lora_name", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}={value!r}: expected a str or None")


NO_EXTRAS = HashExtras()


def extend_block_hashes(
    prev: tuple[BlockHash, ...],
    token_ids: Sequence[int],
    block_size: int,
    extras: HashExtras = NO_EXTRAS,
) -> tuple[BlockHash, ...]:
    """`prev` plus the hashes of the full blocks of `token_ids` it does not cover yet."""
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: expected an int >= 1")
    num_full = len(token_ids) // block_size
    if len(prev) > num_full:
        raise ValueError(
            f"{len(prev)} block hashes already given but {len(token_ids)} tokens hold only "
            f"{num_full} full blocks of {block_size}"
        )
    span_ends = [offset + length for _, offset, length in extras.mm_spans]
    lora = _text(b"l", extras.lora_name)
    salt = _text(b"s", extras.cache_salt)
    hashes = list(prev)
    parent = prev[-1] if prev else b""
    for index in range(len(prev), num_full):
        start = index * block_size
        tokens = token_ids[start : start + block_size]
        try:
            packed = struct.pack(f"<{block_size}q", *tokens)
        except struct.error as err:
            raise ValueError(
                f"token ids {list(tokens)!r} of block {index}: expected 64-bit ints ({err})"
            ) from None
        digest = hashlib.sha256(_MAGIC)
        digest.update(bytes((len(parent),)))
        digest.update(parent)
        digest.update(_U32.pack(block_size))
        digest.update(packed)
        first_span = bisect_right(span_ends, start)
        for mm_hash, offset, _ in extras.mm_spans[first_span:]:
            if offset >= start + block_size:
                break
            digest.update(_text(b"m", mm_hash))
            digest.update(_I64.pack(offset))
        digest.update(lora)
        if index == 0:
            digest.update(salt)
        parent = digest.digest()
        hashes.append(parent)
    return tuple(hashes)


def _text(tag: bytes, value: str | None) -> bytes:
    if value is None:
        return b""
    raw = value.encode("utf-8")
    return tag + _U32.pack(len(raw)) + raw


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
