"""Encoder inputs within a scheduling step: which ones a step's token range needs, committing
that plan, and which request computes each newly allocated encoder output."""

from collections.abc import Mapping

from runtime.core.encoder import encoder_cache as ec
from runtime.core.outputs import frozen_mapping
from runtime.core.request import Request

__all__ = ["assign_encoder_work", "plan_encoder_inputs", "take_encoder_inputs"]


def plan_encoder_inputs(
    encoder: ec.EncoderCache, budget: int, request: Request, computed: int, num_new: int
) -> tuple[ec.EncoderCache, tuple[int, ...], int, int]:
    """Which encoder inputs this step's token range [computed, computed + num_new) needs.

    Returns the encoder cache with them referenced, their indices, the (possibly cut) number of
    tokens and the encoder budget left. A needed input that cannot be computed this step cuts
    the range to the tokens before it; if the range already starts inside it (a prefix hit),
    nothing can be scheduled.
    """
    if not request.mm_inputs:
        return encoder, (), num_new, budget
    taken = []
    for position, item in enumerate(request.mm_inputs):
        if item.offset >= computed + num_new:
            break
        if item.end <= computed:
            continue
        owner = (request.request_id, position)
        entry = encoder.entries.get(item.content_hash)
        if entry is not None:
            if owner not in entry.refs:
                encoder = ec.add_ref(encoder, item.content_hash, owner)
                taken.append(position)
            continue
        if item.num_embeds > budget or not ec.can_allocate(encoder, item.num_embeds):
            num_new = item.offset - computed if computed < item.offset else 0
            break
        encoder = ec.allocate(encoder, item.content_hash, owner, item.num_embeds)
        budget -= item.num_embeds
        taken.append(position)
    return encoder, tuple(taken), num_new, budget


def take_encoder_inputs(
    current: ec.EncoderCache,
    request: Request,
    planned: ec.EncoderCache,
    planned_from: ec.EncoderCache,
    taken: tuple[int, ...],
) -> ec.EncoderCache:
    """Commit a plan. If preemptions released encoder refs since it was made, replay it on the
    current cache instead (they only freed space, so it still fits)."""
    if current is planned_from:
        return planned
    encoder = current
    for position in taken:
        item = request.mm_inputs[position]
        owner = (request.request_id, position)
        if ec.is_cached(encoder, item.content_hash):
            encoder = ec.add_ref(encoder, item.content_hash, owner)
        else:
            encoder = ec.allocate(encoder, item.content_hash, owner, item.num_embeds)
    return encoder


def assign_encoder_work(
    encoder: ec.EncoderCache, to_compute: tuple[str, ...], batch: dict[str, int]
) -> Mapping[str, tuple[int, ...]]:
    """Each entry allocated this step is computed once, by its first user in batch order (every
    user of such an entry is scheduled this step: users that were preempted dropped their refs)."""
    if not to_compute:
        return frozen_mapping({})
    position = {request_id: k for k, request_id in enumerate(batch)}
    work: dict[str, list[int]] = {}
    for content_hash in to_compute:
        request_id, index = min(
            encoder.entries[content_hash].refs, key=lambda o: (position[o[0]], o[1])
        )
        work.setdefault(request_id, []).append(index)
    return frozen_mapping({rid: tuple(sorted(work[rid])) for rid in batch if rid in work})
