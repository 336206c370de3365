"""allowed_token_ids and bad words in the jitted sampler, against their numpy definition on random
batches (vLLM V1 order: allowed ids, bad words, min_tokens, logit bias, penalties)."""

import numpy as np
import pytest

from runtime.core.request import SamplingParams
from runtime.runner.sampler import process_logits, sample
from runtime.runner.sampling_metadata import SamplingRow, make_sampling_metadata

V = 32
EOS = (7,)


def _md(rows, num_rows, step=0):
    return make_sampling_metadata(rows, num_rows=num_rows, vocab_size=V, global_seed=99, step=step)


def _row(params, rid, prompt, output):
    return SamplingRow(rid, params, list(prompt) + list(output), len(prompt), EOS)


def _banned(params, output) -> set[int]:
    """vLLM's bad-words rule: a sequence's last token is banned when the output (never the
    prompt) ends with the rest of it."""
    out = list(output)
    banned = set()
    for seq in params.bad_words_token_ids or ():
        prefix = list(seq[:-1])
        if len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix:
            banned.add(seq[-1])
    return banned


def _reference(logits, params, prompt, output):
    x = logits.astype(np.float64)
    if params.allowed_token_ids is not None:
        keep = np.zeros(V, bool)
        keep[list(params.allowed_token_ids)] = True
        x = np.where(keep, x, -np.inf)
    x[sorted(_banned(params, output))] = -np.inf
    if len(output) < params.min_tokens:
        x[list(params.stop_token_ids) + ([] if params.ignore_eos else list(EOS))] = -np.inf
    for t, b in params.logit_bias or ():
        x[t] += b
    counts = np.bincount(np.asarray(output, int), minlength=V)
    seen = (counts + np.bincount(np.asarray(prompt, int), minlength=V)) > 0
    rep = np.where(seen, params.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def _random_params(rng, temperature):
    # A small alphabet for outputs and bad words, so that prefixes often match and often do not.
    kw = dict(temperature=temperature)
    if rng.random() < 0.6:
        kw["allowed_token_ids"] = rng.choice(V, int(rng.integers(1, 12)), replace=False).tolist()
    if rng.random() < 0.7:
        sequences = [
            tuple(int(t) for t in rng.integers(0, 6, int(rng.integers(1, 4))))
            for _ in range(int(rng.integers(1, 5)))
        ]
        kw["bad_words"] = [f"w{i}" for i in range(len(sequences))]
        kw["bad_words_token_ids"] = sequences
    if rng.random() < 0.3:
        kw["min_tokens"] = int(rng.integers(1, 4))
        kw["stop_token_ids"] = [int(rng.integers(0, V))]
    if rng.random() < 0.4:
        kw["logit_bias"] = {int(rng.integers(0, V)): float(rng.normal(0, 3))}
    if rng.random() < 0.3:
        kw["repetition_penalty"] = float(rng.uniform(0.8, 1.5))
        kw["frequency_penalty"] = float(rng.uniform(-1, 1))
    return SamplingParams(**kw)


def _random_batch(rng, temperature=0.0, num=None, num_rows=16):
    num = int(rng.integers(1, num_rows - 3)) if num is None else num
    cases = []
    for _ in range(num):
        params = _random_params(rng, temperature)
        prompt = rng.integers(0, 6, int(rng.integers(1, 5))).tolist()
        output = rng.integers(0, 6, int(rng.integers(0, 6))).tolist()
        cases.append((params, prompt, output))
    rows = [_row(p, f"r{i}", pr, out) for i, (p, pr, out) in enumerate(cases)]
    return cases, rows, num_rows


def test_processed_logits_match_the_definition_on_random_batches():
    rng = np.random.default_rng(11)
    triggered = untriggered = restricted = 0
    for _ in range(60):
        cases, rows, num_rows = _random_batch(rng)
        logits = rng.normal(0, 2, (num_rows, V)).astype(np.float32)
        got = np.asarray(process_logits(logits, _md(rows, num_rows)))
        for i, (params, prompt, output) in enumerate(cases):
            want = _reference(logits[i], params, prompt, output)
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=str(params))
            for seq in params.bad_words_token_ids or ():
                if len(seq) > 1:
                    hit = seq[-1] in _banned(params, output)
                    triggered += hit
                    untriggered += not hit
            restricted += params.allowed_token_ids is not None
        np.testing.assert_array_equal(got[len(rows) :], logits[len(rows) :])
    # The batches exercised both sides of the prefix rule, and the allowed mask.
    assert triggered > 20 and untriggered > 20 and restricted > 100


def test_a_prefix_in_the_prompt_bans_nothing():
    words = SamplingParams(bad_words=["x"], bad_words_token_ids=[(3, 4), (5,)])
    logits = np.zeros((8, V), np.float32)
    rows = [
        _row(words, "prompt-ends-with-3", [1, 3], []),
        _row(words, "output-ends-with-3", [1], [3]),
        _row(words, "output-ends-with-3-then-2", [1], [3, 2]),
    ]
    got = np.asarray(process_logits(logits, _md(rows, 8)))
    assert np.isneginf(got[:3, 5]).all()  # a one-token word is always banned
    assert [bool(np.isneginf(got[i, 4])) for i in range(3)] == [False, True, False]


def test_sampled_tokens_stay_in_the_allowed_set_and_off_bad_words():
    rng = np.random.default_rng(12)
    for temperature in (0.0, 1.0, 2.0):
        for step in range(3):
            cases, rows, num_rows = _random_batch(rng, temperature, num=60, num_rows=64)
            logits = rng.normal(0, 2, (num_rows, V)).astype(np.float32)
            tokens = np.asarray(sample(logits, _md(rows, num_rows, step=step)).token_ids)
            for i, (params, prompt, output) in enumerate(cases):
                want = _reference(logits[i], params, prompt, output)
                if np.isneginf(want).all():
                    continue  # nothing left to sample: the row's token is meaningless
                assert np.isfinite(want[tokens[i]]), (params, output, tokens[i])
                if temperature == 0.0:
                    assert tokens[i] == np.argmax(want)


def test_uniform_logits_sample_every_allowed_id_and_nothing_else():
    allowed = [2, 9, 17, 30]
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    rows = [_row(params, f"r{i}", [1], []) for i in range(2048)]
    tokens = np.asarray(sample(np.zeros((2048, V), np.float32), _md(rows, 2048)).token_ids)
    counts = np.bincount(tokens, minlength=V)
    assert set(np.flatnonzero(counts)) == set(allowed)
    assert np.abs(counts[allowed] / 2048 - 0.25).max() < 0.05


def test_request_mixes_within_a_bucket_share_one_compilation():
    rng = np.random.default_rng(13)
    logits = rng.normal(0, 2, (8, V)).astype(np.float32)
    plain = SamplingParams(temperature=0.0)
    words = SamplingParams(temperature=0.0, bad_words=["a"], bad_words_token_ids=[(1, 2), (3,)])
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[4, 5, 6])
    mixes = [
        [plain],
        [plain, words],
        [words, words, plain],
        [words, plain, plain, words],
    ]
    process_logits(logits, _md([_row(p, f"r{i}", [1], [1]) for i, p in enumerate(mixes[0])], 8))
    before = process_logits._cache_size()
    for mix in mixes:
        for output in ([], [1], [2, 1]):
            rows = [_row(p, f"r{i}", [1], output) for i, p in enumerate(mix)]
            process_logits(logits, _md(rows, 8))
    # Bad words ride in the min-tokens mask array: no new shape while they fit its width.
    assert process_logits._cache_size() == before
    # allowed_token_ids is one more variant (its stage is skipped when no row uses it), and the
    # same one for every mix that uses it.
    for mix in ([allowed], [allowed, plain], [words, allowed, allowed]):
        process_logits(logits, _md([_row(p, f"r{i}", [1], [1]) for i, p in enumerate(mix)], 8))
    assert process_logits._cache_size() == before + 1


def test_out_of_vocab_ids_name_the_request():
    bad = SamplingParams(allowed_token_ids=[3, V])
    with pytest.raises(ValueError, match=rf"request 'r0': allowed_token_ids contains token id {V}"):
        _md([_row(bad, "r0", [1], [])], 8)
    words = SamplingParams(bad_words=["a"], bad_words_token_ids=[(V + 1,)])
    with pytest.raises(ValueError, match="request 'r1': bad_words_token_ids contains token id 33"):
        _md([_row(SamplingParams(), "r0", [1], []), _row(words, "r1", [1], [])], 8)
