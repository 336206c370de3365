"""The cache budget: how many KV blocks and recurrent-state slots the runner allocates.

A model's cache specs (model/base.py) say what one block id costs over every paged pool
(`bytes_per_block`) and what one state slot costs over every state pool (`bytes_per_slot`). A model
with state specs gets one slot per sequence that may run, max_num_seqs: the core admits a request
only when a slot is free, so fewer slots would quietly cap the batch below max_num_seqs. The state
pools also hold one scratch row for the batch's padding rows. The slots' bytes are set aside first
and the rest of the byte budget is divided into blocks; a budget that cannot hold max_num_seqs
slots beside one whole request is refused with the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model import base

DEFAULT_KV_CACHE_BYTES = 2 << 30


class KVCacheSizeError(ValueError):
    """The cache cannot hold one request of max_model_len tokens, or max_num_seqs state slots."""


@dataclass(frozen=True, slots=True)
class CacheSize:
    num_blocks: int  # KV blocks, block 0 (the null block) included
    num_state_slots: int  # slots the core hands out (0: no state specs); pools hold one more row
    kv_bytes: int  # num_blocks * bytes_per_block
    state_bytes: int  # (num_state_slots + 1) * bytes_per_slot; 0 without state specs


def plan_cache(
    specs: Sequence[base.CacheSpec],
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None,
    kv_cache_bytes: int | None,
) -> CacheSize:
    """Blocks and state slots of the cache. Blocks: `num_kv_blocks` as given, or what a byte
    budget (`kv_cache_bytes`, else the default, then no more than max_num_seqs whole requests
    need) holds after the state slots' bytes; either must hold one whole request."""
    per_block = base.bytes_per_block(specs)
    per_slot = base.bytes_per_slot(specs)
    block_size = base.paged_specs(specs)[0].block_size
    num_slots = max_num_seqs if base.has_state(specs) else 0
    state_bytes = (num_slots + 1) * per_slot if num_slots else 0
    need = -(-max_model_len // block_size) + 1  # one request's blocks plus the null block
    if num_kv_blocks is None:
        budget = kv_cache_bytes if kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
        if state_bytes and budget < state_bytes + need * per_block:
            raise KVCacheSizeError(
                _slots_do_not_fit(
                    specs, max_model_len, max_num_seqs, need, budget, kv_cache_bytes is not None
                )
            )
        by_budget = (budget - state_bytes) // per_block
        full = max_num_seqs * (need - 1) + 1
        num_kv_blocks = by_budget if kv_cache_bytes is not None else min(full, by_budget)
    if num_kv_blocks < need:
        raise KVCacheSizeError(
            f"max_model_len={max_model_len} needs {need - 1} KV blocks of {block_size} tokens "
            f"({(need - 1) * per_block} bytes) for one request, but the KV cache has "
            f"{max(num_kv_blocks - 1, 0)} usable blocks ({num_kv_blocks * per_block} bytes at "
            f"{per_block} bytes per block: "
            + ", ".join(f"{s.name} {s.bytes_per_block}" for s in base.paged_specs(specs))
            + (f"; {state_bytes} bytes of state slots set aside" if state_bytes else "")
            + "); lower max_model_len or raise num_kv_blocks / kv_cache_bytes"
        )
    return CacheSize(num_kv_blocks, num_slots, num_kv_blocks * per_block, state_bytes)


def _slots_do_not_fit(specs, max_model_len, max_num_seqs, need, budget, given) -> str:
    per_block = base.bytes_per_block(specs)
    per_slot = base.bytes_per_slot(specs)
    block_size = base.paged_specs(specs)[0].block_size
    # Slots that fit beside one request's blocks, less the scratch row.
    fit = (budget - need * per_block) // per_slot - 1
    what = f"kv_cache_bytes={budget}" if given else f"the default cache budget of {budget} bytes"
    head = (
        f"max_num_seqs={max_num_seqs} needs {max_num_seqs} state slots + 1 scratch of {per_slot} "
        f"bytes each ({(max_num_seqs + 1) * per_slot} bytes: "
        + ", ".join(f"{s.name} {s.bytes_per_slot}" for s in base.state_specs(specs))
        + f" per slot), set aside before the KV blocks, and max_model_len={max_model_len} needs "
        f"{need - 1} KV blocks of {block_size} tokens plus the null block ({need * per_block} "
        f"bytes); {what} holds "
    )
    if fit >= 1:
        return head + (
            f"only {fit} state slot{'s' if fit > 1 else ''} beside them: lower max_num_seqs to "
            f"{fit} or raise kv_cache_bytes"
        )
    return head + "not one state slot beside them: raise kv_cache_bytes or lower max_model_len"
