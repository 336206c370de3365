"""SchedulerOutput -> one padded ragged device batch.

The runner keeps a small mutable mirror of each live request (its tokens and block table), updated from
the scheduler's new-request data and cached-request deltas. Every step the scheduled tokens of all
requests are laid out back to back in one flat token axis; sizes are padded up to a few bucket sizes so
that the number of compiled shapes stays small and known.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pallas_kernels.ragged_paged_attention import tiles

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 256
_NO_SLOTS: Mapping[str, int] = {}


@dataclass
class RequestRow:
    """The runner's mirror of one live request (shell state, mutated in place)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    prompt_len: int
    sampling_params: object
    num_computed_tokens: int = 0
    # Prompt positions whose logprobs were returned (position p: the logprob of token p + 1).
    # A preempted request computes its prompt again; those positions are not returned twice.
    num_prompt_logprobs_done: int = 0
    # EOS ids the sampler holds back while the request is below min_tokens.
    eos_token_ids: tuple[int, ...] = ()
    # Its multimodal items (placeholder runs and content hashes), as the scheduler gave them.
    mm_inputs: tuple = ()


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... up to the first power of two >= hi (so `hi` itself always fits)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(b)
    return tuple(out)


def half_step_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two times lo with a 1.5x step between each pair: lo, 1.5lo, 2lo, 3lo, 4lo, ...

    Padding waste is at most a third instead of a half, for twice the shapes.
    """
    out = []
    for b in power_of_two_buckets(lo, hi):
        out.append(b)
        half = b + b // 2
        if b % 2 == 0 and half < hi:
            out.append(half)
    return tuple(out)


def quarter_step_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two times lo with 1.25x, 1.5x and 1.75x steps between each pair: lo, 1.25lo,
    1.5lo, 1.75lo, 2lo, 2.5lo, ... (sizes rounded down to whole numbers, repeats dropped).

    Padding waste is at most a fifth, for about twice the shapes of half_step_buckets.
    """
    out: list[int] = []
    for b in power_of_two_buckets(lo, hi):
        for size in (b, b + b // 4, b + b // 2, b + 3 * b // 4):
            if (not out or size > out[-1]) and (size == b or size < hi):
                out.append(size)
    return tuple(out)


# From this many rows a decode step pads to quarter steps (160, 192, 224, 256, 320, ...), below it
# to half steps: past it a step's dots cost enough that a fifth's padding at most beats the
# third's, for two more shapes per doubling. Measured on the multimodal benchmark (200 requests
# decoding together, 256 sequences a step): 200 rows ran as 224 instead of 256, 7.43 and 7.99 s
# against 7.65 and 8.19 (vlax side, alternating).
QUARTER_STEP_ROWS = 128


def decode_row_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Half steps from lo below QUARTER_STEP_ROWS, quarter steps from it up to hi's bucket."""
    half = set(half_step_buckets(lo, hi))
    return tuple(b for b in quarter_step_buckets(lo, hi) if b in half or b >= QUARTER_STEP_ROWS)


# (tokens, seqs, blocks per seq, live decode chunks or 0, live tile pairs or 0): a step's padded
# shape, one compilation of the whole step each (BatchBuilder.shape).
Shape = tuple[int, int, int, int, int]


def bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class HostBatch:
    """One step's device inputs as host arrays, plus where each request's rows landed."""

    arrays: dict[str, np.ndarray]
    req_ids: tuple[str, ...]  # batch order
    sampling_req_ids: tuple[str, ...]  # requests that sample a token this step, in logits-row order
    prompt_logprob_rows: dict[str, tuple[int, int]] = field(
        default_factory=dict
    )  # req -> (start, n)
    num_tokens: int = 0
    # ModelBatch.decode_chunks: the bucketed live KV chunks of a one-token-per-sequence step
    # (0: another step, or a builder without decode_chunk_blocks).
    decode_chunks: int = 0
    # ModelBatch.tile_chunks: the bucketed live (query tile, KV chunk) pairs of another step
    # (0: a decode step, or a builder without tiled_steps).
    tile_chunks: int = 0


class BatchBuilder:
    def __init__(
        self,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_state_slots: int = 0,
        decode_chunk_blocks: int = 0,
        tiled_steps: bool = False,
    ) -> None:
        self.block_size = block_size
        # 0: the model keeps no recurrent state. Otherwise slots 0..n-1 are the core's and n is
        # the scratch slot that padding rows read and write.
        self.num_state_slots = num_state_slots
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Every distinct shape is one more compilation of the whole step, but a decode step's
        # weight matmuls and LM head cost what its padded rows do, so its tokens and sequences are
        # bucketed in 1.5x steps (16, 24, 32, 48, 64, ...), not powers of two. Measured on the
        # offline benchmark's Llama, f32, one process alternating the two: a decode step of 40
        # rows 94.4 ms padded to 48 against 103.0 ms padded to 64; of 20 rows 64.3 against 71.0.
        # From QUARTER_STEP_ROWS rows, quarter steps.
        self.seq_buckets = decode_row_buckets(min(8, max_num_seqs), max_num_seqs)
        # Past max_num_seqs tokens a step holds a prompt or chunk: quarter steps there (padding at
        # most a fifth, for a few more prefill shapes), as its padded rows cost what its dots and
        # MLP cost. Measured on the multimodal benchmark (f32, 200 requests in rounds of 64): the
        # third step of each round, 1042 tokens, ran padded to 1536; at 1280 the whole run took
        # 7.88-8.31 s against 8.49-8.65 (three runs each). Decode-sized steps keep the decode rows'
        # buckets.
        decode = set(decode_row_buckets(16, max_num_batched_tokens))  # within the quarter steps
        self.token_buckets = tuple(
            b
            for b in quarter_step_buckets(16, max_num_batched_tokens)
            if b > max_num_seqs or b in decode
        )
        # The table width bounds the context every sequence gathers; bucketing it to the batch's
        # longest context (at least MIN_CONTEXT_BUCKET tokens) keeps short-context steps from
        # paying for max_model_len. Half steps here: the paged-attention gather of every sequence's
        # context dominates a decode step on the CPU (64 x 768-token contexts: 3/4 of the 1024 bucket).
        first = min(-(-MIN_CONTEXT_BUCKET // block_size), self.max_blocks_per_seq)
        self.block_buckets = tuple(
            min(b, self.max_blocks_per_seq)
            for b in half_step_buckets(first, self.max_blocks_per_seq)
        )
        # Blocks per KV chunk of the jnp decode path (decode.chunk_blocks; 0: the model's
        # attention does not take decode_chunks). A step whose every sequence has one query token
        # then has a live-chunk count, bucketed per sequence bucket (decode_chunk_buckets), in
        # place of a table-width bucket: its table is always max_blocks_per_seq wide, as its
        # attention cost follows the live chunks and not the width.
        self.decode_chunk_blocks = decode_chunk_blocks
        # Whether every other step (not one token per sequence) of the jnp path counts its live
        # (query tile, KV chunk) pairs (tiles.tile_chunks), bucketed per token and sequence bucket
        # (tile_chunk_buckets), in place of a table-width bucket, as decode steps count chunks.
        # Off for a prefix LM: a prefix reaches past what the count sees (the dispatcher would
        # take the reference anyway, and the counts would only add shapes).
        self.tiled_steps = tiled_steps and decode_chunk_blocks > 0
        self._seen_shapes: set[Shape] = set()

    def decode_chunk_buckets(self, s_pad: int) -> tuple[int, ...]:
        """Live-chunk buckets of a one-token-per-sequence step padded to s_pad sequences:
        s_pad x (1, 1.25, 1.5, 1.75, 2, 2.5, ...) up to every sequence at max_model_len. Padding
        chunks cost what live ones do, so the finer steps (a fifth wasted at most, not a third)
        pay for their extra shapes: 19% of the offline benchmark's decode chunks were padding
        under 1.5x steps."""
        per_seq = -(-self.max_blocks_per_seq // self.decode_chunk_blocks)
        return quarter_step_buckets(s_pad, s_pad * per_seq)

    def tile_bucket(self, rows: Iterable[tuple[int, int]], t_pad: int, s_pad: int) -> int:
        """The pair bucket of a tiled step padded to t_pad tokens and s_pad sequences whose rows
        have these (query tokens, context length including them)."""
        live = tiles.tile_chunks(rows, self.block_size)
        return bucket(live, self.tile_chunk_buckets(t_pad, s_pad))

    def tile_chunk_buckets(self, t_pad: int, s_pad: int) -> tuple[int, ...]:
        """Pair buckets of a tiled step padded to t_pad tokens and s_pad sequences: from the
        fewest a step of more than t_pad / 2 tokens can hold to the most (every tile at the
        widest table), in 1.5x steps."""
        lo = max(1, t_pad // (2 * tiles.TILE_QUERIES))
        hi = tiles.max_tile_chunks(t_pad, s_pad, self.max_blocks_per_seq, self.block_size)
        return half_step_buckets(lo, max(lo, hi))

    def chunks_of(self, context: int) -> int:
        """KV chunks of one sequence's context of this many tokens on the decode path."""
        return -(-context // (self.decode_chunk_blocks * self.block_size))

    def shape(self, q_lens: Sequence[int], kv_lens: Sequence[int]) -> Shape:
        """The padded shape of a step whose rows schedule q_lens[i] tokens and reach a context of
        kv_lens[i] tokens with them: what build() pads the step to, decided here only (the
        warm-up compiles the shapes a planned run gives here)."""
        num_tokens = sum(q_lens)
        t_pad = bucket(num_tokens, self.token_buckets)
        s_pad = bucket(len(q_lens), self.seq_buckets)
        decode = (
            self.decode_chunk_blocks > 0
            and num_tokens == len(q_lens) > 0
            and all(n == 1 for n in q_lens)
        )
        if decode:
            live = sum(self.chunks_of(n) for n in kv_lens)
            chunks = bucket(live, self.decode_chunk_buckets(s_pad))
            return (t_pad, s_pad, self.max_blocks_per_seq, chunks, 0)
        if self.tiled_steps and num_tokens > 0:
            pairs = self.tile_bucket(zip(q_lens, kv_lens, strict=True), t_pad, s_pad)
            return (t_pad, s_pad, self.max_blocks_per_seq, 0, pairs)
        longest = max(kv_lens, default=1)
        return (t_pad, s_pad, bucket(-(-longest // self.block_size), self.block_buckets), 0, 0)

    def build(
        self,
        rows: Mapping[str, RequestRow],
        num_scheduled_tokens: Mapping[str, int],
        order: Sequence[str],
        *,
        want_prompt_logprobs: frozenset[str] = frozenset(),
        state_slots: Mapping[str, int] = _NO_SLOTS,
        reset_state_slots: Collection[int] = (),
    ) -> HostBatch:
        bs = self.block_size
        q_lens = [num_scheduled_tokens[r] for r in order]
        shape = self.shape(
            q_lens, [rows[r].num_computed_tokens + n for r, n in zip(order, q_lens, strict=True)]
        )
        t_pad, s_pad, mb_pad, chunks, pairs = shape
        num_tokens = sum(q_lens)

        # Built as Python lists and converted once per array: per-row numpy calls cost more
        # than the data (a decode row is one token).
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        kv_lens: list[int] = []
        cu_q_lens = [0]
        sampling, logits_rows, prompt_rows = [], [], {}
        start = 0
        for rid in order:
            row = rows[rid]
            n = num_scheduled_tokens[rid]
            c = row.num_computed_tokens
            end = c + n
            table = row.block_ids
            if n == 1:
                tokens.append(row.token_ids[c])
                positions.append(c)
                slots.append(table[c // bs] * bs + c % bs)
            else:
                tokens.extend(row.token_ids[c:end])
                positions.extend(range(c, end))
                # One range of slots per block the chunk touches.
                for b in range(c // bs, (end - 1) // bs + 1):
                    base = table[b] * bs
                    slots.extend(range(base + max(c - b * bs, 0), base + min(end - b * bs, bs)))
            used = -(-end // bs)
            tables.append(table[:used] + [0] * (mb_pad - used))
            kv_lens.append(end)
            cu_q_lens.append(start + n)
            if rid in want_prompt_logprobs and c < row.prompt_len:
                prompt_rows[rid] = (start, min(n, row.prompt_len - c))
            if end >= len(row.token_ids):
                sampling.append(rid)
                logits_rows.append(start + n - 1)
            start += n
        num_seqs = len(order)

        def padded(values: list[int], size: int, fill: int = 0) -> np.ndarray:
            out = np.full(size, fill, np.int32)
            out[: len(values)] = values
            return out

        block_tables = np.zeros((s_pad, mb_pad), np.int32)
        if tables:
            block_tables[:num_seqs] = tables
        cu = padded(cu_q_lens, s_pad + 1)
        cu[num_seqs + 1 :] = start
        state_rows, reset_rows = self._state_rows(rows, order, state_slots, reset_state_slots)
        # Padding rows start from zero state every step, so the scratch slot never carries
        # anything from one step to the next.
        state_reset = np.ones(s_pad, np.bool_)
        state_reset[:num_seqs] = reset_rows
        if shape not in self._seen_shapes:
            self._seen_shapes.add(shape)
            log.info(
                "batch bucket in use: tokens=%d seqs=%d blocks/seq=%d chunks=%d pairs=%d", *shape
            )

        arrays = dict(
            token_ids=padded(tokens, t_pad),
            positions=padded(positions, t_pad),
            slot_mapping=padded(slots, t_pad, -1),
            block_tables=block_tables,
            kv_lens=padded(kv_lens, s_pad),
            cu_q_lens=cu,
            num_seqs=np.asarray(num_seqs, np.int32),
            logits_indices=padded(logits_rows, s_pad),
            state_slots=padded(state_rows, s_pad, self.num_state_slots),
            state_reset=state_reset,
        )
        return HostBatch(
            arrays,
            tuple(order),
            tuple(sampling),
            prompt_rows,
            num_tokens,
            decode_chunks=chunks,
            tile_chunks=pairs,
        )

    def _state_rows(
        self,
        rows: Mapping[str, RequestRow],
        order: Sequence[str],
        state_slots: Mapping[str, int],
        reset_state_slots: Collection[int],
    ) -> tuple[list[int], list[bool]]:
        """Each scheduled row's state slot and whether it starts from zero state.

        A slot holds the state of its request's tokens before num_computed_tokens and of nothing
        else, so the core's slots are checked here, where a wrong one would silently give a
        request another request's state (or a state from before its preemption): a row starts
        from zero state exactly when it computes from token 0, no two rows share a slot, and a
        slot reset this step belongs to a row of this step (else its owner, scheduled later,
        would read what the slot's previous owner left).
        """
        n = self.num_state_slots
        if not n:
            return [0] * len(order), [False] * len(order)
        reset = set(reset_state_slots)
        slots, fresh = [], []
        for rid in order:
            slot = state_slots.get(rid)
            if not isinstance(slot, int) or not 0 <= slot < n:
                raise ValueError(
                    f"request {rid!r} is scheduled with state slot {slot!r}; expected one of "
                    f"0..{n - 1}"
                )
            starts = slot in reset
            computed = rows[rid].num_computed_tokens
            if starts != (computed == 0):
                raise ValueError(
                    f"request {rid!r} computes from token {computed} with state slot {slot} "
                    + (
                        "reset: a state started from zero there would miss the tokens before it"
                        if starts
                        else "not reset: it would start from the state the slot's previous "
                        "owner left"
                    )
                )
            slots.append(slot)
            fresh.append(starts)
        if len(set(slots)) != len(slots):
            shared = sorted({s for s in slots if slots.count(s) > 1})
            raise ValueError(f"state slots {shared} are given to more than one request this step")
        stray = reset.difference(slots)
        if stray:
            raise ValueError(
                f"state slots {sorted(stray)} are reset but no request scheduled this step holds "
                "them"
            )
        return slots, fresh
