"""Sampler edges the distribution tests cannot see: a batch whose only penalty is the repetition
penalty, and top-p's cut between two logits one float apart."""

import numpy as np

from runtime.core.request import SamplingParams
from runtime.runner.sampler import process_logits, sample
from runtime.runner.sampling_metadata import SamplingRow, make_sampling_metadata

V = 32


def _md(rows):
    return make_sampling_metadata(rows, num_rows=len(rows), vocab_size=V, global_seed=7, step=3)


def test_a_batch_whose_only_penalty_is_repetition_applies_it():
    rng = np.random.default_rng(0)
    logits = np.clip(rng.normal(0, 0.5, (2, V)), -1.0, 1.0).astype(np.float32)
    logits[0, 3], logits[0, 4], logits[0, 10] = 2.0, -1.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    # Token 3 in the prompt, 4 among the outputs; the second row has no penalty.
    rows = [
        SamplingRow("a", params, (3, 5, 4), 2),
        SamplingRow("b", SamplingParams(temperature=0.0), (3, 4), 2),
    ]
    got = np.asarray(process_logits(logits, _md(rows)))
    want = logits.copy()
    for t in (3, 5, 4):
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # The penalised 2.0 / 1.5 falls below 1.5: greedy picks token 10 over token 3.
    assert int(sample(logits, _md(rows)).token_ids[0]) == 10


def test_top_p_drops_a_token_one_float_below_the_last_it_keeps():
    # Two tokens share nearly all the mass, the second one ulp below the first: top-p 0.3 needs
    # only the first, so the second (not a tie) is never sampled.
    logits = np.full(V, -20.0, np.float32)
    logits[5] = 1.0
    logits[9] = np.nextafter(np.float32(1.0), np.float32(-np.inf))
    params = SamplingParams(temperature=1.0, top_p=0.3)
    rows = [SamplingRow(f"r{i}", params, (1,), 1) for i in range(400)]
    tokens = np.asarray(sample(np.tile(logits, (400, 1)), _md(rows)).token_ids)
    assert set(tokens.tolist()) == {5}
    # Without top-p both are sampled about equally often.
    free = [SamplingRow(f"r{i}", SamplingParams(temperature=1.0), (1,), 1) for i in range(400)]
    tokens = np.asarray(sample(np.tile(logits, (400, 1)), _md(free)).token_ids)
    assert 120 < np.sum(tokens == 9) < 280
