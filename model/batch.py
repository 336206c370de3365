"""The ragged token batch one forward step consumes (built by runtime/runner/inputs.py)."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class ModelBatch:
    token_ids: jax.Array  # int32[T] flat ragged tokens: seq 0's scheduled tokens, then seq 1's, ...
    positions: jax.Array  # int32[T] absolute position of each token in its sequence
    slot_mapping: (
        jax.Array
    )  # int32[T] block * block_size + offset for this token's K/V; -1 = padding
    block_tables: jax.Array  # int32[S, MB] per sequence, its block ids (0-padded)
    kv_lens: jax.Array  # int32[S] context length incl. this step's tokens; 0 for padding rows
    cu_q_lens: jax.Array  # int32[S + 1] query start offsets into the flat token axis
    num_seqs: jax.Array  # int32[] sequences actually present
    logits_indices: jax.Array  # int32[R] rows whose logits are wanted (padded with 0)
    # Recurrent state (model/base.py StateCacheSpec). The runner always fills both; a model
    # without state specs ignores them (None only from callers that predate state slots).
    state_slots: jax.Array | None = None  # int32[S] each row's state slot; padding: num_slots
    state_reset: jax.Array | None = None  # bool[S] the row starts from zero state this step
    # BERT token types: 1 marks a cross-encoder pair's second text. The runner fills it for
    # families that read it; None (every token 0) otherwise.
    token_type_ids: jax.Array | None = None  # int32[T]
    # Multimodal (PaliGemma / ColPali): the runner's encoder path fills these; None for text-only
    # steps and families. mm_mask marks the rows of this step's tokens that take mm_embeds' row
    # (same index) instead of the token embedding; rows where it is False are ignored.
    mm_embeds: jax.Array | None = None  # float[T, hidden]
    mm_mask: jax.Array | None = None  # bool[T]
    # Per sequence, the length of its bidirectional prefix (PaliGemma's prefix-LM: image tokens +
    # prompt attend to each other both ways, the generated suffix causally). None: causal only.
    # The runner keeps a prefix whole in one step, so a prefix never spans two steps' queries.
    prefix_lens: jax.Array | None = None  # int32[S]
    # Static (part of the compiled program): > 0 on a step where every sequence has one query
    # token, bounding the step's live KV chunks, so the jnp attention path gathers those only
    # (pallas_kernels/ragged_paged_attention/decode.py); 0 otherwise.
    decode_chunks: int = struct.field(pytree_node=False, default=0)
    # Static: > 0 on another step of a causal model, bounding its live (query tile, KV chunk)
    # pairs, so the jnp attention path attends those only (ragged_paged_attention/tiles.py).
    tile_chunks: int = struct.field(pytree_node=False, default=0)
