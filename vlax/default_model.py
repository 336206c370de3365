"""The embedded default checkpoint: a small random-weight Llama written on first use.

Everything in it is a deterministic function of this file and `default_corpus.py` (fixed numpy seed,
single-file BPE training), so every machine gets byte-identical files. It is written into a
temporary directory and renamed into place, so concurrent first uses never see half a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pallas_kernels.platform import cache_root
from vlax.default_corpus import CORPUS

DEFAULT_MODEL_VERSION = "1"
_SEED = 20240601
_BPE_VOCAB_SIZE = 1024
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2

ARCH = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def default_model_path(cache_dir: Path | None = None) -> Path:
    """The default checkpoint directory under `cache_dir` (default `cache_root()`), written if
    absent. Safe to call from several processes at once."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / f"default-llama-{DEFAULT_MODEL_VERSION}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        write_default_model(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process renamed its identical copy first; theirs is complete.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_default_model(directory: Path) -> None:
    """Write the checkpoint's files into an existing empty `directory`."""
    directory = Path(directory)
    tokenizer = train_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
    )
    _write_json(directory / "config.json", _model_config(vocab_size))
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    )
    save_file(_weights(vocab_size), str(directory / "model.safetensors"), metadata={"format": "pt"})


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on the embedded corpus; BOS is added by the post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    return tok


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": ARCH["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


def _model_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **ARCH,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
    }


def _weights(vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    h, inter = ARCH["hidden_size"], ARCH["intermediate_size"]
    q_dim = ARCH["num_attention_heads"] * ARCH["head_dim"]
    kv_dim = ARCH["num_key_value_heads"] * ARCH["head_dim"]

    # Scales chosen so random logits are sharp (clear greedy gaps, robust to f32/bf16 rounding)
    # and the layers mix context (outputs are not a fixed per-token mapping).
    def normal(std: float, *shape: int) -> np.ndarray:
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def proj(out_dim: int, in_dim: int) -> np.ndarray:
        return normal(in_dim**-0.5, out_dim, in_dim)

    w = {"model.embed_tokens.weight": normal(1.0, vocab_size, h)}
    for i in range(ARCH["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = proj(q_dim, h)
        w[p + "self_attn.k_proj.weight"] = proj(kv_dim, h)
        w[p + "self_attn.v_proj.weight"] = proj(kv_dim, h)
        w[p + "self_attn.o_proj.weight"] = proj(h, q_dim)
        w[p + "mlp.gate_proj.weight"] = proj(inter, h)
        w[p + "mlp.up_proj.weight"] = proj(inter, h)
        w[p + "mlp.down_proj.weight"] = proj(h, inter)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = normal(4.0 * h**-0.5, vocab_size, h)
    return w


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
