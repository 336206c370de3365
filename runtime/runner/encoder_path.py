"""The runner's encoder path: the vision tower's outputs by content hash, and their rows in a step.

The core decides everything (runtime/core/encoder): which items a step encodes
(`scheduled_encoder_inputs`) and which outputs the runner may drop (`free_encoder_hashes`). This
file only follows it: it runs the vision tower on exactly the items the step names, keeps the
outputs on the device by hash, and lays this step's rows out for the model: `mm_embeds[t]` is the
embedding of the placeholder at token row t where `mm_mask[t]` holds. A step's token range may
start or end inside an item's placeholder run (a chunk boundary, a prefix hit): its rows take that
item's embeddings from the matching offset.

Which items a request has comes with the step (NewRequestData.mm_inputs, kept on the runner's
request row), so a request id reused after its old request finished names the new request's
items, in the order the runner drops and adds rows. Images are kept by content hash too: one copy
however many live requests show it. They are handed over when a request is admitted, before the
runner hears of it, and dropped when the runner hears that the last request holding them finished.

A step that fails before the device took the KV cache is undone: outputs it computed are dropped
(the core, back at the state of before the step, still thinks them uncomputed) and nothing was
freed (frees and finished requests are applied only once a step went through).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runtime.core.outputs import SchedulerOutput
from runtime.core.request import MultiModalInput
from runtime.runner.inputs import power_of_two_buckets, quarter_step_buckets

log = logging.getLogger(__name__)


@jax.jit
def _encode(graphdef, params, pixels):
    return nnx.merge(graphdef, params).encode_images(pixels)


@partial(jax.jit, static_argnames=("num_rows",))
def _rows(source, item, embed, mask, *, num_rows):
    """[num_rows, hidden]: source[item[t], embed[t]] where mask[t], zeros elsewhere."""
    out = source[item, embed]
    return jnp.where(mask[:, None], out, jnp.zeros((), out.dtype))[:num_rows]


class EncoderMiss(RuntimeError):
    """A step needs an encoder output the runner does not hold: the core and the runner disagree."""


class EncoderPath:
    def __init__(self, graphdef, params, *, image_size: int, num_image_tokens: int) -> None:
        self.graphdef, self.params = graphdef, params
        self.image_size = image_size
        self.num_image_tokens = num_image_tokens
        probe = jax.eval_shape(
            lambda p: _encode(graphdef, params, p),
            jax.ShapeDtypeStruct((1, 3, image_size, image_size), jnp.float32),
        )
        if probe.shape[1] != num_image_tokens:
            raise ValueError(
                f"the vision tower gives {probe.shape[1]} embeddings per image, but the config "
                f"says {num_image_tokens} image tokens"
            )
        self.hidden, self.dtype = probe.shape[2], probe.dtype
        # Images by content hash, and how many admitted requests hold each.
        self.pixels: dict[str, np.ndarray] = {}
        self._holders: dict[str, int] = {}
        # Request id -> the hashes of each admission under that id, oldest first. An id may be
        # admitted again before the runner hears that its old request finished; each finish the
        # runner hears releases the oldest admission (a finished one: a live request's admission
        # is never older than one whose finish is still to be heard).
        self._admissions: dict[str, deque[tuple[str, ...]]] = {}
        # content hash -> float[num_embeds, hidden] on the device.
        self.outputs: dict[str, jax.Array] = {}
        # Images the vision tower has encoded, over the runner's life (padding rows not counted).
        self.num_encoded = 0
        self._computed_this_step: list[str] = []
        self._empty = jnp.zeros((1, num_image_tokens, self.hidden), self.dtype)
        # The vision tower's batch pads to quarter steps (a fifth wasted at most): its cost is
        # its padded images', and power-of-two padding ran the multimodal benchmark's 20 images
        # as 32. Splicing stacks only the step's encoder outputs, so powers of two serve there.
        self._encode_buckets = quarter_step_buckets(1, 1 << 12)
        self._splice_buckets = power_of_two_buckets(1, 1 << 12)

    def add_request(
        self, request_id: str, items: Sequence[MultiModalInput], pixels: Sequence[np.ndarray]
    ) -> None:
        """A request was admitted (every request of the model, with or without images): keep its
        images until the runner hears it finished."""
        if len(items) != len(pixels):
            raise ValueError(
                f"request {request_id!r}: {len(items)} multimodal items but {len(pixels)} images"
            )
        hashes = tuple(item.content_hash for item in items)
        for content_hash, image in zip(hashes, pixels, strict=True):
            self.pixels.setdefault(content_hash, image)
            self._holders[content_hash] = self._holders.get(content_hash, 0) + 1
        self._admissions.setdefault(request_id, deque()).append(hashes)

    def encode(
        self,
        scheduled: Mapping[str, tuple[int, ...]],
        items_of: Mapping[str, Sequence[MultiModalInput]],
    ) -> None:
        """Run the vision tower once over every item this step asks for (one batch);
        `items_of[request_id]` is the request's multimodal items (its mm_inputs)."""
        self._computed_this_step = []
        todo: dict[str, np.ndarray] = {}
        for request_id, indices in scheduled.items():
            for index in indices:
                try:
                    content_hash = items_of[request_id][index].content_hash
                    pixels = self.pixels[content_hash]
                except (KeyError, IndexError):
                    raise EncoderMiss(
                        f"the step asks to encode item {index} of request {request_id!r}, "
                        "whose image the runner was never given (or dropped)"
                    ) from None
                todo.setdefault(content_hash, pixels)
        if not todo:
            return
        hashes = list(todo)
        n = len(hashes)
        padded = next(b for b in self._encode_buckets if b >= n)
        batch = np.zeros((padded, 3, self.image_size, self.image_size), np.float32)
        batch[:n] = np.stack([todo[h] for h in hashes])
        embeds = _encode(self.graphdef, self.params, batch.astype(self.dtype))
        for k, content_hash in enumerate(hashes):
            self.outputs[content_hash] = embeds[k]
        self.num_encoded += n
        self._computed_this_step = hashes

    def rows(
        self,
        order: Sequence[str],
        items_of: Mapping[str, Sequence[MultiModalInput]],
        computed: Mapping[str, int],
        num_scheduled: Mapping[str, int],
        num_rows: int,
    ) -> tuple[jax.Array, np.ndarray]:
        """(mm_embeds [num_rows, hidden], mm_mask [num_rows]) for this step's token rows, laid
        out as the batch builder lays out tokens (each request's scheduled tokens in `order`);
        `items_of[request_id]` is the request's multimodal items."""
        used: dict[str, int] = {}
        item_of = np.zeros(num_rows, np.int32)
        embed_of = np.zeros(num_rows, np.int32)
        mask = np.zeros(num_rows, np.bool_)
        start = 0
        for request_id in order:
            first = computed[request_id]
            end = first + num_scheduled[request_id]
            for item in items_of.get(request_id, ()):
                lo, hi = max(first, item.offset), min(end, item.end)
                if lo >= hi:
                    continue
                if item.content_hash not in self.outputs:
                    raise EncoderMiss(
                        f"request {request_id!r} computes placeholder rows {lo}..{hi - 1} of "
                        f"item {item.content_hash[:12]}, whose encoder output the runner does "
                        "not hold (never computed, or freed)"
                    )
                slot = used.setdefault(item.content_hash, len(used))
                rows = slice(start + lo - first, start + hi - first)
                item_of[rows] = slot
                embed_of[rows] = np.arange(lo - item.offset, hi - item.offset)
                mask[rows] = True
            start += end - first
        if used:
            sources = [self.outputs[h] for h in used]
            width = next(b for b in self._splice_buckets if b >= len(sources))
            sources += [sources[0]] * (width - len(sources))
            source = jnp.stack(sources)
        else:
            source = self._empty
        return _rows(source, item_of, embed_of, mask, num_rows=num_rows), mask

    def end_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step went through: drop what the core freed, and the images no request that is
        still live holds."""
        for content_hash in scheduler_output.free_encoder_hashes:
            self.outputs.pop(content_hash, None)
        for request_id in scheduler_output.finished_req_ids:
            self._release(request_id)
        self._computed_this_step = []

    def undo_step(self) -> None:
        """The step failed before the device took the KV cache: forget what it encoded."""
        for content_hash in self._computed_this_step:
            self.outputs.pop(content_hash, None)
            self.num_encoded -= 1
        self._computed_this_step = []

    def _release(self, request_id: str) -> None:
        """The runner heard that `request_id` finished: its oldest admission lets go of its
        images (a request the runner was never given: nothing)."""
        admissions = self._admissions.get(request_id)
        if not admissions:
            return
        for content_hash in admissions.popleft():
            self._holders[content_hash] -= 1
            if not self._holders[content_hash]:
                del self._holders[content_hash], self.pixels[content_hash]
        if not admissions:
            del self._admissions[request_id]
