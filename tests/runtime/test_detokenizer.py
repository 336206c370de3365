"""Incremental detokenization (byte-level BPE) and stop strings, against full decodes."""

import numpy as np
import pytest
from transformers import AutoTokenizer

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
    # Lead-heavy random bytes: long held runs (mostly invalid, some characters completed across
    # a would-be cut), so held runs get cut, or refused a cut, many times (50 such sequences:
    # 41 cuts, 6 refusals), and the text must stay a prefix of the full decode through each.
    byte_ids = [_byte_token(tok, b) for b in [0xE2, 0xF0, 0xC3, *range(0x80, 0xA0)]]
    weights = np.array([8.0] * 3 + [1.0] * 32)
    sequences += [rng.choice(byte_ids, 200, p=weights / weights.sum()).tolist() for _ in range(6)]
    # Inside a run of 0xFF (never valid in UTF-8), at every offset: "づ" (E3 81 A5) completed by
    # a token that also opens the next character (A5 E3 81), so the text still ends in U+FFFD
    # and the run is still held. Some cut falls inside the "づ" and must be refused, or the text
    # would get U+FFFDs where the full decode has the character.
    split = [_byte_token(tok, b"\xe3\x81"), _byte_token(tok, b"\xa5\xe3\x81")]
    invalid = _byte_token(tok, 0xFF)
    sequences += [[invalid] * j + split + [invalid] * 24 for j in range(24)]
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
                assert d.num_tokens == len(seq)


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
    assert d.output_text == "Hello world" and d.num_tokens == len(ids)
    include = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    d, _ = _stream(tok, include, ids, stop_terminated=True)
    assert d.output_text == "Hello world</s>"


def test_find_stop_string_only_searches_new_text():
    assert find_stop_string("abcSTOPdef", 3, ["STOP"], False) is None
    assert find_stop_string("abcSTOPdef", 5, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOP", 1, ["STOP"], True) == ("STOP", -1)
    assert find_stop_string("abcSTOPx", 2, ["X", "STOP"], True) == ("STOP", 7)
    assert find_stop_string("abc", 0, ["a"], False) is None


class CountingDecodes:
    """The real tokenizer, counting the token ids it is asked to decode (the detokenizer's work)."""

    def __init__(self, tok):
        self._tok = tok
        self.ids_decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids_decoded += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _byte_token(tok, data):
    """The id of the byte-level token whose bytes are `data` (an int: one byte), through GPT-2's
    byte-to-character table."""
    from tokenizers import pre_tokenizers

    data = bytes([data]) if isinstance(data, int) else data
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    # printable bytes map to themselves; the rest to U+0100 onwards, in byte order
    table = {b: chr(b) for b in range(256) if chr(b) in alphabet}
    table.update({b: chr(256 + i) for i, b in enumerate(x for x in range(256) if x not in table)})
    token = tok.backend.token_to_id("".join(table[b] for b in data))
    assert token is not None, f"the default tokenizer has no token for bytes {data.hex()}"
    return token


def test_a_run_that_never_completes_a_character_costs_linear_work(tok):
    """The scenario that used to be quadratic: while the decoded window ends in U+FFFD the
    detokenizer held every token and re-decoded the whole run at each step (3000 lone
    continuation bytes: 4.5 million ids decoded). Now the held run is cut once it is long, at a
    point nothing straddles, so each token costs a bounded number of decoded ids, and the text
    still equals the full decode."""
    n = 3000
    runs = {
        "continuation bytes": [_byte_token(tok, 0xA1)] * n,  # never the start of a character
        "lead bytes": [_byte_token(tok, 0xE2)] * n,  # each cut short by the next one
        "specials": [0] * n,  # skipped: each decodes to nothing
    }
    hello = tok.encode("Hello ", add_special_tokens=False)
    hf = AutoTokenizer.from_pretrained(tok.path)  # the oracle: how HF decodes the whole sequence
    for name, run in runs.items():
        seq = hello + run + tok.encode(" café 🙂", add_special_tokens=False)
        assert tok.decode(seq) == hf.decode(seq, skip_special_tokens=True)
        for chunk in (1, 7):
            counting = CountingDecodes(tok)
            d = IncrementalDetokenizer(counting, SamplingParams(), prompt_token_ids=[1, 300])
            for i in range(0, len(seq), chunk):
                d.update(seq[i : i + chunk], finished=i + chunk >= len(seq))
            assert d.output_text == tok.decode(seq), name
            per_token = counting.ids_decoded / len(seq)
            assert per_token < 100, f"{name}: {per_token:.0f} ids decoded per token"


def _vllm_fast_text(tok, ids, skip, spaces):
    """vLLM 0.33 FastIncrementalDetokenizer's text: tokenizers' DecodeStream step by step, and
    under spaces_between_special_tokens=False an added token right after another emitted as its
    own content."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=skip)
    raw = not (skip or spaces)
    text, after_added = "", False
    for i in ids:
        piece = stream.step(tok.backend, i) or ""
        if raw:
            content = tok.added_token_contents.get(i)
            if content is not None and after_added:
                piece = content
            after_added = content is not None
        text += piece
    return text


def test_spaces_between_special_tokens_as_vllm(tok):
    """vLLM's spaces_between_special_tokens on WordPiece (MiniLM, whose decoder spaces every
    token: "[CLS] [SEP]") and byte-level BPE (the default checkpoint): the text equals vLLM's fast
    detokenizer rule over tokenizers' DecodeStream, for runs of added tokens, added tokens among
    words, and either flag."""
    from benchmarks.embed_throughput import minilm_path

    wordpiece = Tokenizer.from_pretrained(minilm_path())
    cls, sep, mask = 101, 102, 103
    hello = wordpiece.encode("hello world", add_special_tokens=False)
    cases = {
        wordpiece: [
            [cls, sep, mask, *hello, sep, sep],
            [*hello, cls, cls, *hello, mask],
            [sep],
        ],
        tok: [[*tok.encode("hi there", add_special_tokens=False), *sorted(tok.all_special_ids)]],
    }
    for tokenizer, sequences in cases.items():
        for ids in sequences:
            for skip in (True, False):
                for spaces in (True, False):
                    params = SamplingParams(
                        skip_special_tokens=skip, spaces_between_special_tokens=spaces
                    )
                    d, _ = _stream(tokenizer, params, ids)
                    want = _vllm_fast_text(tokenizer, ids, skip, spaces)
                    assert d.output_text == want, (ids, skip, spaces)
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    d, _ = _stream(wordpiece, params, [cls, sep, mask, *hello, sep, sep])
    assert d.output_text == "[CLS][SEP][MASK] hello world [SEP][SEP]"
    with pytest.raises(ValueError, match="spaces_between_special_tokens=1: expected a bool"):
        SamplingParams(spaces_between_special_tokens=1)
