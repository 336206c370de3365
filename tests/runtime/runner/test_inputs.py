import numpy as np
import pytest

from runtime.runner.inputs import (
    BatchBuilder,
    RequestRow,
    bucket,
    half_step_buckets,
    power_of_two_buckets,
    quarter_step_buckets,
)


def test_buckets_cover_the_limit():
    assert power_of_two_buckets(16, 100) == (16, 32, 64, 128)
    assert power_of_two_buckets(1, 1) == (1,)
    assert bucket(17, (16, 32)) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket 32"):
        bucket(33, (16, 32))


def test_quarter_step_buckets_waste_at_most_a_fifth():
    assert quarter_step_buckets(64, 512) == (
        64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
    )  # fmt: skip
    assert quarter_step_buckets(3, 20) == (3, 4, 5, 6, 7, 9, 10, 12, 15, 18, 24)
    assert quarter_step_buckets(1, 1) == (1,)
    for lo, hi in ((64, 512), (8, 128), (5, 300)):
        buckets = quarter_step_buckets(lo, hi)
        assert buckets[-1] >= hi and list(buckets) == sorted(set(buckets))
        for n in range(lo + 1, hi + 1):
            assert bucket(n, buckets) <= max(n * 5 / 4, n + 1), n


def test_context_buckets_take_half_steps_and_end_at_the_table_width():
    assert half_step_buckets(16, 64) == (16, 24, 32, 48, 64)
    assert half_step_buckets(3, 20) == (3, 6, 9, 12, 18, 24)
    assert half_step_buckets(1, 1) == (1,)
    bb = BatchBuilder(block_size=16, max_model_len=1000, max_num_seqs=8, max_num_batched_tokens=64)
    # 1000 tokens are 63 blocks: the last bucket is the table width, not the next power of two.
    assert bb.block_buckets == (16, 24, 32, 48, 63)
    # Every width up to the limit lands in a bucket wasting at most a third of it.
    for blocks in range(17, 64):
        padded = bucket(blocks, bb.block_buckets)
        assert blocks <= padded < 1.5 * blocks or padded == 63


def test_decode_rows_pad_to_half_steps_not_powers_of_two():
    """A decode step's matmuls and LM head cost its padded rows: 40 rows run as 48, not 64."""
    bb = BatchBuilder(
        block_size=16, max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048
    )
    for rows, tokens, seqs in (
        (40, 48, 48),
        (20, 24, 24),
        (33, 48, 48),
        (49, 64, 64),
        (10, 16, 12),
    ):
        assert bb.shape([1] * rows, [100] * rows)[:2] == (tokens, seqs), rows
    # From 128 rows, quarter steps: 200 rows run as 224, not 256.
    wide = BatchBuilder(
        block_size=16, max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=4096
    )
    for rows, padded in ((200, 224), (129, 160), (193, 224), (225, 256), (100, 128), (70, 96)):
        assert wide.shape([1] * rows, [100] * rows)[:2] == (padded, padded), rows


def test_prompt_steps_pad_to_quarter_steps_past_max_num_seqs():
    """Past max_num_seqs tokens a step holds prompts: padded to at most a fifth more (1042 tokens
    ran as 1536 before, now 1280), while decode-sized steps keep the half steps above."""
    bb = BatchBuilder(
        block_size=16, max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048
    )
    for tokens, padded in (
        (1042, 1280),
        (1300, 1536),
        (2039, 2048),
        (640, 640),
        (65, 80),
        (600, 640),
    ):
        rows = -(-tokens // 100)
        q_lens = [100] * (rows - 1) + [tokens - 100 * (rows - 1)]
        assert bb.shape(q_lens, q_lens)[0] == padded, tokens
    assert all(b <= 64 or b in bb.token_buckets for b in (80, 96, 112, 1280, 1792))
    assert {40, 56} & set(bb.token_buckets) == set()  # below max_num_seqs: half steps only


def test_mixed_prefill_chunk_and_decode_layout():
    bb = BatchBuilder(block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64)
    rows = {
        # decode: 6 tokens known, 5 computed -> computes the last one and samples
        "a": RequestRow(
            "a",
            list(range(100, 106)),
            [7, 3],
            prompt_len=5,
            sampling_params=None,
            num_computed_tokens=5,
        ),
        # prefill chunk 4..9 of a 12-token prompt: no sample this step
        "b": RequestRow(
            "b",
            list(range(200, 212)),
            [9, 2, 5],
            prompt_len=12,
            sampling_params=None,
            num_computed_tokens=4,
        ),
    }
    hb = bb.build(rows, {"a": 1, "b": 6}, ["a", "b"])
    a = hb.arrays
    assert hb.num_tokens == 7 and a["token_ids"].shape == (16,)
    np.testing.assert_array_equal(a["token_ids"][:7], [105, 204, 205, 206, 207, 208, 209])
    np.testing.assert_array_equal(a["positions"][:7], [5, 4, 5, 6, 7, 8, 9])
    # slot = block * 4 + offset: a's position 5 -> block 3 offset 1; b's 4..9 -> blocks 2, 2, 2, 2, 5, 5
    np.testing.assert_array_equal(a["slot_mapping"][:7], [13, 8, 9, 10, 11, 20, 21])
    assert (a["slot_mapping"][7:] == -1).all()
    np.testing.assert_array_equal(a["cu_q_lens"], [0, 1] + [7] * 7)
    np.testing.assert_array_equal(a["kv_lens"], [6, 10] + [0] * 6)
    assert int(a["num_seqs"]) == 2
    assert a["block_tables"].shape == (8, 16)  # max_model_len 64 caps the 256-token bucket
    np.testing.assert_array_equal(a["block_tables"][1, :3], [9, 2, 5])
    assert hb.sampling_req_ids == ("a",)
    assert a["logits_indices"][0] == 0


def test_random_batches_match_a_per_token_layout():
    """The builder's list-based layout against the definition, token by token, on random mixes of
    decodes and prefill chunks starting and ending anywhere in a block."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        bs = int(rng.choice([1, 2, 4, 16]))
        bb = BatchBuilder(
            block_size=bs, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512
        )
        rows, scheduled, budget = {}, {}, 512
        for i in range(int(rng.integers(1, 13))):
            prompt = int(rng.integers(1, 100))
            total = prompt + int(rng.integers(0, 50))
            c = int(rng.integers(0, total))
            n = min(int(rng.integers(1, total - c + 1)), budget)
            if n <= 0:
                break
            budget -= n
            used = -(-(c + n) // bs)
            table = rng.choice(np.arange(1, 5000), used + int(rng.integers(0, 3)), replace=False)
            rid = f"r{i}"
            rows[rid] = RequestRow(
                rid,
                rng.integers(0, 1000, total).tolist(),
                table.tolist(),
                prompt_len=prompt,
                sampling_params=None,
                num_computed_tokens=c,
            )
            scheduled[rid] = n
        order = list(rows)
        hb = bb.build(rows, scheduled, order)
        a = hb.arrays
        flat = 0
        for i, rid in enumerate(order):
            row, n = rows[rid], scheduled[rid]
            c = row.num_computed_tokens
            for k, pos in enumerate(range(c, c + n)):
                assert a["token_ids"][flat + k] == row.token_ids[pos]
                assert a["positions"][flat + k] == pos
                assert a["slot_mapping"][flat + k] == row.block_ids[pos // bs] * bs + pos % bs
            used = -(-(c + n) // bs)
            np.testing.assert_array_equal(a["block_tables"][i, :used], row.block_ids[:used])
            assert not a["block_tables"][i, used:].any()
            assert a["kv_lens"][i] == c + n and a["cu_q_lens"][i + 1] == flat + n
            flat += n
        assert (a["slot_mapping"][flat:] == -1).all() and not a["token_ids"][flat:].any()
        assert (a["cu_q_lens"][len(order) + 1 :] == flat).all() and not a["kv_lens"][
            len(order) :
        ].any()
        assert not a["block_tables"][len(order) :].any() and int(a["num_seqs"]) == len(order)
        assert all(a[k].dtype == np.int32 for k in a if k != "state_reset")
        # A model without state slots: every row names slot 0 (the scratch of an empty pool).
        assert not a["state_slots"].any() and a["state_reset"].dtype == np.bool_
