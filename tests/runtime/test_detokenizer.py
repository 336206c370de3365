"""Incremental detokenization (byte-level BPE) and stop strings, against full decodes."""

import numpy as np
import pytest

from runtime.core.request import SamplingParams
from runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from runtime.tokenizer import Tokenizer
from vlax.default_model import default_model_path

MULTILINGUAL = "Über 🙂🚀 café — 今日はいい天気ですね。 你好 안녕하세요 ±€ ok"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(default_model_path(tmp_path_factory.mktemp("cache")))


def _stream(tok, params, ids, prompt=(), chunk=1, stop_terminated=False):
    d = IncrementalDetokenizer(tok, params, prompt)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        stop = d.update(ids[i : i + chunk], stop_terminated=stop_terminated and last, finished=last)
        deltas.append(d.next_output_text(finished=last or stop is not None, delta=True))
        if stop is not None:
            break
    assert "".join(deltas) == d.output_text  # streamed deltas add up to the final text
    return d, stop


def test_incremental_equals_full_decode_at_every_step(tok):
    rng = np.random.default_rng(0)
    # multi-byte characters split across tokens, plus random ids (invalid byte runs, specials)
    sequences = [tok.encode(MULTILINGUAL, add_special_tokens=False)]
    sequences += [rng.integers(0, tok.vocab_size, 40).tolist() for _ in range(30)]
    split = [i for i in sequences[0] if tok.decode([i]).endswith("\ufffd")]
    assert split, "the corpus text should contain characters split across tokens"
    for seq in sequences:
        for skip in (True, False):
            for chunk in (1, 3):
                params = SamplingParams(skip_special_tokens=skip)
                d = IncrementalDetokenizer(tok, params, prompt_token_ids=[1, 300, 301])
                for i in range(0, len(seq), chunk):
                    d.update(seq[i : i + chunk])
                    full = tok.decode(seq[: i + chunk], skip_special_tokens=skip)
                    assert full.startswith(d.output_text)
                    if not full.endswith("\ufffd"):
                        assert d.output_text == full
                d.update([], finished=True)
                assert d.output_text == tok.decode(seq, skip_special_tokens=skip)
                assert d.token_ids == seq


def test_stop_strings_split_across_tokens(tok):
    text = "Hello world, the robot stop here 🙂 please"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(tok.encode("stop here", add_special_tokens=False)) > 1
    d, stop = _stream(tok, SamplingParams(stop=["stop here", "never"]), ids)
    assert stop == "stop here" and d.output_text == "Hello world, the robot "
    d, stop = _stream(
        tok, SamplingParams(stop=["stop here"], include_stop_str_in_output=True), ids, chunk=4
    )
    assert stop == "stop here" and d.output_text == "Hello world, the robot stop here"
    d, stop = _stream(tok, SamplingParams(stop=["🙂"]), ids)  # a character split over tokens
    assert stop == "🙂" and d.output_text == "Hello world, the robot stop here "
    d, stop = _stream(tok, SamplingParams(stop=["zebra"]), ids, chunk=5)
    assert stop is None and d.output_text == text


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("ab stop cd stop ef", add_special_tokens=False)
    first = next(n for n in range(1, len(ids)) if "stop" in tok.decode(ids[:n]))
    for chunk in (1, 2, len(ids)):  # text of the first min_tokens tokens is never scanned
        d, stop = _stream(tok, SamplingParams(stop=["stop"], min_tokens=first), ids, chunk=chunk)
        assert stop == "stop" and d.output_text == "ab stop cd "
        d, stop = _stream(
            tok, SamplingParams(stop=["stop"], min_tokens=first - 1), ids, chunk=chunk
        )
        assert stop == "stop" and d.output_text == "ab "
        d, stop = _stream(tok, SamplingParams(stop=["stop"], min_tokens=len(ids)), ids, chunk=chunk)
        assert stop is None and d.output_text == "ab stop cd stop ef"


def test_stop_token_text_is_left_out_unless_included(tok):
    ids = tok.encode("Hello world", add_special_tokens=False) + [2]
    keep_specials = SamplingParams(skip_special_tokens=False)
    d, _ = _stream(tok, keep_specials, ids, stop_terminated=True)
    assert d.output_text == "Hello world" and d.token_ids == ids
    include = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    d, _ = _stream(tok, include, ids, stop_terminated=True)
    assert d.output_text == "Hello world</s>"


def test_find_stop_string_only_searches_new_text():
    assert find_stop_string("abcSTOPdef", 3, ["STOP"], False) is None
    assert find_stop_string("abcSTOPdef", 5, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOP", 1, ["STOP"], True) == ("STOP", -1)
    assert find_stop_string("abcSTOPx", 2, ["X", "STOP"], True) == ("STOP", 7)
    assert find_stop_string("abc", 0, ["a"], False) is None
