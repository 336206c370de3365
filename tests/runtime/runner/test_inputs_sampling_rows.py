"""Which rows of a batch sample and which return prompt logprobs, including requests resumed after
preemption, which recompute their prompt and their earlier outputs (a row past its prompt is not
yet caught up). Both slips here survived the layout tests, which never look at these fields."""

import numpy as np

from runtime.runner.inputs import BatchBuilder, RequestRow

BS = 4


def _builder():
    return BatchBuilder(
        block_size=BS, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512
    )


def _row(rid, prompt_len, total, computed):
    table = list(range(1, -(-total // BS) + 1))
    tokens = list(range(10, 10 + total))
    return RequestRow(rid, tokens, table, prompt_len, None, num_computed_tokens=computed)


def test_a_resumed_request_samples_only_once_its_outputs_are_recomputed():
    # 5 prompt tokens and 4 earlier outputs, recomputed in two chunks after a preemption.
    rows = {"r": _row("r", 5, 9, 0)}
    first = _builder().build(rows, {"r": 6}, ["r"], want_prompt_logprobs=frozenset({"r"}))
    assert first.sampling_req_ids == ()
    assert first.prompt_logprob_rows == {"r": (0, 5)}  # the prompt's rows, not the outputs'
    rows["r"].num_computed_tokens = 6
    second = _builder().build(rows, {"r": 3}, ["r"], want_prompt_logprobs=frozenset({"r"}))
    assert second.sampling_req_ids == ("r",) and second.arrays["logits_indices"][0] == 2
    assert second.prompt_logprob_rows == {}


def test_sampling_and_prompt_rows_on_random_batches_follow_their_definition():
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows, scheduled = {}, {}
        for i in range(int(rng.integers(1, 10))):
            prompt = int(rng.integers(1, 40))
            total = prompt + int(rng.integers(0, 20))
            computed = int(rng.integers(0, total))
            rid = f"r{i}"
            rows[rid] = _row(rid, prompt, total, computed)
            scheduled[rid] = int(rng.integers(1, total - computed + 1))
        order = list(rows)
        want = frozenset(r for r in order if rng.random() < 0.5)
        batch = _builder().build(rows, scheduled, order, want_prompt_logprobs=want)
        start, sampling, logits_rows, prompt_rows = 0, [], [], {}
        for rid in order:
            row, n = rows[rid], scheduled[rid]
            c = row.num_computed_tokens
            if c + n == len(row.token_ids):  # caught up with every token it has
                sampling.append(rid)
                logits_rows.append(start + n - 1)
            if rid in want and c < row.prompt_len:
                prompt_rows[rid] = (start, min(c + n, row.prompt_len) - c)
            start += n
        assert batch.sampling_req_ids == tuple(sampling)
        np.testing.assert_array_equal(batch.arrays["logits_indices"][: len(sampling)], logits_rows)
        assert batch.prompt_logprob_rows == prompt_rows
