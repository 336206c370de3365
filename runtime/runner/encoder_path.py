"""The runner's encoder path: the vision tower's outputs by content hash, and their rows in a step.

The core decides everything (runtime/core/encoder): which items a step encodes
(`scheduled_encoder_inputs`) and which outputs the runner may drop (`free_encoder_hashes`). This
file only follows it: it runs the vision tower on exactly the items the step names (each item's
pixels were handed over when its request was admitted), keeps the outputs on the device by hash,
and lays this step's rows out for the model: `mm_embeds[t]` is the embedding of the placeholder at
token row t where `mm_mask[t]` holds. A step's token range may start or end inside an item's
placeholder run (a chunk boundary, a prefix hit): its rows take that item's embeddings from the
matching offset.

A step that fails before the device took the KV cache is undone: outputs it computed are dropped
(the core, back at the state of before the step, still thinks them uncomputed) and nothing was
freed (frees and finished requests are applied only once a step went through).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runtime.core.outputs import SchedulerOutput
from runtime.core.request import MultiModalInput
from runtime.runner.inputs import power_of_two_buckets

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
        # Live requests' items and pixels (index-aligned), given at admission.
        self.items: dict[str, tuple[MultiModalInput, ...]] = {}
        self.pixels: dict[str, tuple[np.ndarray, ...]] = {}
        # content hash -> float[num_embeds, hidden] on the device.
        self.outputs: dict[str, jax.Array] = {}
        # Images the vision tower has encoded, over the runner's life (padding rows not counted).
        self.num_encoded = 0
        self._computed_this_step: list[str] = []
        self._empty = jnp.zeros((1, num_image_tokens, self.hidden), self.dtype)
        self._batch_buckets = power_of_two_buckets(1, 1 << 12)

    def add_request(
        self, request_id: str, items: Sequence[MultiModalInput], pixels: Sequence[np.ndarray]
    ) -> None:
        if len(items) != len(pixels):
            raise ValueError(
                f"request {request_id!r}: {len(items)} multimodal items but {len(pixels)} images"
            )
        if items:
            self.items[request_id] = tuple(items)
            self.pixels[request_id] = tuple(pixels)

    def encode(self, scheduled: Mapping[str, tuple[int, ...]]) -> None:
        """Run the vision tower once over every item this step asks for (one batch)."""
        self._computed_this_step = []
        todo: dict[str, np.ndarray] = {}
        for request_id, indices in scheduled.items():
            for index in indices:
                try:
                    item = self.items[request_id][index]
                    pixels = self.pixels[request_id][index]
                except (KeyError, IndexError):
                    raise EncoderMiss(
                        f"the step asks to encode item {index} of request {request_id!r}, "
                        "whose images the runner was never given"
                    ) from None
                todo.setdefault(item.content_hash, pixels)
        if not todo:
            return
        hashes = list(todo)
        n = len(hashes)
        padded = next(b for b in self._batch_buckets if b >= n)
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
        computed: Mapping[str, int],
        num_scheduled: Mapping[str, int],
        num_rows: int,
    ) -> tuple[jax.Array, np.ndarray]:
        """(mm_embeds [num_rows, hidden], mm_mask [num_rows]) for this step's token rows, laid
        out as the batch builder lays out tokens (each request's scheduled tokens in `order`)."""
        used: dict[str, int] = {}
        item_of = np.zeros(num_rows, np.int32)
        embed_of = np.zeros(num_rows, np.int32)
        mask = np.zeros(num_rows, np.bool_)
        start = 0
        for request_id in order:
            first = computed[request_id]
            end = first + num_scheduled[request_id]
            for item in self.items.get(request_id, ()):
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
            width = next(b for b in self._batch_buckets if b >= len(sources))
            sources += [sources[0]] * (width - len(sources))
            source = jnp.stack(sources)
        else:
            source = self._empty
        return _rows(source, item_of, embed_of, mask, num_rows=num_rows), mask

    def end_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step went through: drop what the core freed and the finished requests' images."""
        for content_hash in scheduler_output.free_encoder_hashes:
            self.outputs.pop(content_hash, None)
        for request_id in scheduler_output.finished_req_ids:
            self.items.pop(request_id, None)
            self.pixels.pop(request_id, None)
        self._computed_this_step = []

    def undo_step(self) -> None:
        """The step failed before the device took the KV cache: forget what it encoded."""
        for content_hash in self._computed_this_step:
            self.outputs.pop(content_hash, None)
            self.num_encoded -= 1
        self._computed_this_step = []
