"""Sampler: each stage against a direct numpy computation, distributions by many rows, seeds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.core.request import SamplingParams
from runtime.runner.sampler import compute_prompt_logprobs, process_logits, sample
from runtime.runner.sampling_metadata import (
    SamplingRow,
    logprobs_bucket,
    make_sampling_metadata,
)

V = 32


def _md(rows, num_rows=None, step=0, global_seed=1234):
    return make_sampling_metadata(
        rows,
        num_rows=num_rows or len(rows),
        vocab_size=V,
        global_seed=global_seed,
        step=step,
    )


def _row(params, rid="r", prompt=(1, 2), output=(), eos=()):
    return SamplingRow(rid, params, tuple(prompt) + tuple(output), len(prompt), eos)


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def _reference_probs(logits, p: SamplingParams):
    """vLLM V1 on one row: temperature, min-p, top-k, top-p; returns the sampling distribution."""
    x = logits / p.temperature
    probs = _softmax(x)
    x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(V, bool)
    k = V if p.top_k in (0, -1) else p.top_k
    kept = order[:k]
    pk = _softmax(x[kept])
    before = np.cumsum(pk) - pk
    kept = kept[: max(1, int(np.sum(before < p.top_p)))]
    keep[kept] = True
    return _softmax(np.where(keep, x, -np.inf))


def test_distributions_match_reference_for_each_parameter():
    rng = np.random.default_rng(0)
    groups = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.7),
        SamplingParams(temperature=0.9, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.3, top_k=10, top_p=0.8, min_p=0.05),
    ]
    per_group = 3000
    base = [rng.normal(0, 1.5, V).astype(np.float32) for _ in groups]
    rows, logits = [], []
    for g, p in enumerate(groups):
        for i in range(per_group):
            rows.append(_row(p, rid=f"g{g}-{i}"))
            logits.append(base[g])
    tokens = np.asarray(sample(np.stack(logits), _md(rows)).token_ids)
    for g, p in enumerate(groups):
        got = tokens[g * per_group : (g + 1) * per_group]
        want = _reference_probs(base[g].astype(np.float64), p)
        assert set(got) <= set(np.flatnonzero(want > 0)), f"group {p}: sampled outside support"
        freq = np.bincount(got, minlength=V) / per_group
        tol = 4 * np.sqrt(want * (1 - want) / per_group) + 2e-3
        assert np.all(np.abs(freq - want) <= tol), (p, freq, want)


def test_top_k_and_top_p_never_leave_their_set():
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=2.0, top_k=k) for k in (1, 2, 5)]
    params += [SamplingParams(temperature=2.0, top_p=tp) for tp in (0.05, 0.3, 0.9)]
    rows, logits, allowed = [], [], []
    for i in range(1200):
        p = params[i % len(params)]
        x = rng.normal(0, 2, V).astype(np.float32)
        rows.append(_row(p, rid=str(i)))
        logits.append(x)
        allowed.append(_reference_probs(x.astype(np.float64), p) > 0)
    tokens = np.asarray(sample(np.stack(logits), _md(rows)).token_ids)
    assert all(allowed[i][t] for i, t in enumerate(tokens))


def test_penalties_bias_and_min_tokens_match_numpy():
    rng = np.random.default_rng(2)
    eos = (7, 12)  # every EOS id is held back below min_tokens
    cases = [
        (SamplingParams(repetition_penalty=1.3), (3, 4, 4), (5, 3)),
        (SamplingParams(frequency_penalty=0.7), (3, 9), (5, 5, 5, 6)),
        (SamplingParams(presence_penalty=-0.4), (3,), (5, 5, 6, 6, 6)),
        (
            SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=1.1),
            (1, 2, 3),
            (2, 2, 11),
        ),
        (SamplingParams(logit_bias={4: 5.0, 30: -2.5}), (1,), (4,)),
        (SamplingParams(min_tokens=3, stop_token_ids=(2, 9)), (1,), (4, 5)),
        (SamplingParams(min_tokens=2, stop_token_ids=(2,)), (1,), (4, 5)),
        (SamplingParams(min_tokens=3, ignore_eos=True), (1,), ()),
    ]
    rows = [
        _row(p, rid=str(i), prompt=pr, output=out, eos=eos) for i, (p, pr, out) in enumerate(cases)
    ]
    logits = rng.normal(0, 2, (len(rows) + 2, V)).astype(np.float32)
    md = _md(rows, num_rows=len(rows) + 2)
    got = np.asarray(process_logits(logits, md))
    for i, (p, prompt, output) in enumerate(cases):
        x = logits[i].astype(np.float64)
        if len(output) < p.min_tokens:
            stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
            x[stop] = -np.inf
        for t, b in p.logit_bias or ():
            x[t] += b
        counts = np.bincount(np.asarray(output, int), minlength=V)
        seen = (counts + np.bincount(np.asarray(prompt, int), minlength=V)) > 0
        rep = np.where(seen, p.repetition_penalty, 1.0)
        x = np.where(x > 0, x / rep, x * rep)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        np.testing.assert_allclose(got[i], x, rtol=1e-5, atol=1e-5, err_msg=str(p))
    np.testing.assert_array_equal(got[len(rows) :], logits[len(rows) :])
    # greedy rows take the argmax of the processed logits
    greedy = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, temperature=0.0)) for r in rows
    ]
    tokens = np.asarray(sample(logits, _md(greedy, num_rows=len(rows) + 2)).token_ids)
    np.testing.assert_array_equal(tokens, got.argmax(-1))


def test_greedy_is_argmax_and_bias_forces_tokens():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (64, V)).astype(np.float32)
    rows = [_row(SamplingParams(temperature=0.0 if i % 2 else 1e-6), rid=str(i)) for i in range(60)]
    tokens = np.asarray(sample(logits, _md(rows, num_rows=64)).token_ids)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    forced = [
        _row(SamplingParams(temperature=1.0, logit_bias={i % V: 100.0}), rid=str(i))
        for i in range(64)
    ]
    tokens = np.asarray(sample(logits, _md(forced)).token_ids)
    np.testing.assert_array_equal(tokens, np.arange(64) % V)


def test_argmax_takes_the_first_maximum_in_any_chunk_of_any_vocab():
    """_argmax searches one chunk of columns after a max per chunk: ties within and across
    chunks, the maximum in a last partial chunk, -inf rows, as np.argmax; a NaN row gives an
    index in range."""
    from runtime.runner.sampler import ARGMAX_CHUNK, _argmax

    rng = np.random.default_rng(11)
    for vocab in (1, 7, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK - 5, 32000):
        x = rng.integers(-3, 4, (9, vocab)).astype(np.float32)  # many ties
        x[1] = -np.inf
        x[2, -1] = 50.0  # in the last (partial) chunk
        x[3, : min(vocab, 2 * ARGMAX_CHUNK)] = 9.0  # a tie spanning chunks
        x[4] = np.nan
        got = np.asarray(jax.jit(_argmax)(jnp.asarray(x)))
        np.testing.assert_array_equal(np.delete(got, 4), np.delete(x, 4, 0).argmax(-1), str(vocab))
        assert 0 <= got[4] < vocab, vocab


def test_logprobs_and_ranks_are_raw_and_padded_rows_stay_finite():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 2, (16, V)).astype(np.float32)
    logits[3, :4] = logits[3].max() + 1  # ties at the top
    rows = [
        _row(
            SamplingParams(temperature=0.8, presence_penalty=1.0, logit_bias={5: 3.0}),
            rid=str(i),
            output=(5, 6),
        )
        for i in range(12)
    ]
    md = _md(rows, num_rows=16)
    for k in (0, 5):
        out = sample(logits.astype(np.float32), md, num_logprobs=k)
        ids, vals, ranks = (np.asarray(a) for a in (out.logprob_token_ids, out.logprobs, out.ranks))
        assert ids.shape == vals.shape == (16, k + 1)
        assert np.all(np.isfinite(vals))
        lp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        tokens = np.asarray(out.token_ids)
        np.testing.assert_array_equal(ids[:, 0], tokens)
        np.testing.assert_allclose(vals[:, 0], lp[np.arange(16), tokens], atol=1e-5)
        np.testing.assert_array_equal(ranks, (lp >= lp[np.arange(16), tokens][:, None]).sum(-1))
        top = np.sort(lp, -1)[:, ::-1][:, :k]
        np.testing.assert_allclose(vals[:, 1:], top, atol=1e-5)
        np.testing.assert_allclose(np.take_along_axis(lp, ids[:, 1:], -1), top, atol=1e-5)


def test_prompt_logprobs_match_numpy():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, (9, V)).astype(np.float32)
    nxt = rng.integers(0, V, 9).astype(np.int32)
    ids, vals, ranks = (np.asarray(a) for a in compute_prompt_logprobs(logits, nxt, 3))
    lp = np.log(_softmax(logits.astype(np.float64)))
    np.testing.assert_array_equal(ids[:, 0], nxt)
    np.testing.assert_allclose(vals[:, 0], lp[np.arange(9), nxt], atol=1e-5)
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-lp, -1)[:, :3])
    np.testing.assert_array_equal(ranks, (lp >= lp[np.arange(9), nxt][:, None]).sum(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(6)
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in (0, 1, 2**40 + 3, 99)]
    seeded.append(SamplingParams(temperature=0.7, top_k=8, seed=5))
    x = rng.normal(0, 1, (len(seeded), V)).astype(np.float32)
    outputs = [(), (4,), (4, 4, 4), (), (1, 2)]
    alone = [
        _row(p, rid=f"s{i}", output=o) for i, (p, o) in enumerate(zip(seeded, outputs, strict=True))
    ]
    want = np.asarray(sample(x, _md(alone, step=3)).token_ids)
    others = [
        _row(
            SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, repetition_penalty=1.2),
            rid=f"o{i}",
        )
        for i in range(7)
    ]
    mixed = others[:3] + alone[::-1] + others[3:]
    xm = rng.normal(0, 1, (16, V)).astype(np.float32)
    for j, row in enumerate(mixed):
        if row in alone:
            xm[j] = x[alone.index(row)]
    got = np.asarray(sample(xm, _md(mixed, num_rows=16, step=11, global_seed=7)).token_ids)
    np.testing.assert_array_equal(got[3:8][::-1], want)


def test_rows_sample_independently():
    x = np.zeros((4096, V), np.float32)  # uniform: rows agreeing by chance is 1/V
    p = SamplingParams(temperature=1.0)
    unseeded = _md([_row(p, rid=f"req-{i}") for i in range(4096)])
    seeded = _md([_row(SamplingParams(seed=i), rid="same") for i in range(4096)])
    for md in (unseeded, seeded):
        t = np.asarray(sample(x, md).token_ids)
        assert abs(np.mean(t[:-1] == t[1:]) - 1 / V) < 0.02
        assert np.abs(np.bincount(t, minlength=V) / 4096 - 1 / V).max() < 0.02
    # unseeded rows move on with the engine step; seeded ones with their output position
    a = np.asarray(sample(x, unseeded).token_ids)
    b = np.asarray(sample(x, _md([_row(p, rid=f"req-{i}") for i in range(4096)], step=1)).token_ids)
    assert np.mean(a == b) < 0.1


def test_bad_input_is_rejected_with_clear_errors():
    with pytest.raises(ValueError, match="logit_bias contains token id 40"):
        _md([_row(SamplingParams(logit_bias={40: 1.0}))])
    with pytest.raises(ValueError, match="output_token_ids contains token id 99"):
        _md([_row(SamplingParams(presence_penalty=1.0), output=(99,))])
    with pytest.raises(ValueError, match="num_rows=1 is smaller than the 2 rows"):
        _md([_row(SamplingParams())] * 2, num_rows=1)
    with pytest.raises(ValueError, match="logits shape"):
        sample(np.zeros((2, V), np.float32), _md([_row(SamplingParams())]))
    assert [logprobs_bucket(n) for n in (None, 0, 1, 5, 6, 20, 21)] == [None, 0, 5, 5, 20, 20, 32]
    # Never wider than the vocabulary: top-k of more than V entries does not exist.
    assert [logprobs_bucket(n, vocab_size=V) for n in (6, 21, 32)] == [20, 32, 32]
    assert logprobs_bucket(6, vocab_size=16) == 16
    with pytest.raises(ValueError, match="num_logprobs=17 exceeds the vocabulary size 16"):
        logprobs_bucket(17, vocab_size=16)
