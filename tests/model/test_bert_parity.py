"""BERT on tiny random checkpoints against HF transformers: BertForSequenceClassification's
probabilities and hidden states over many ragged batch shapes (cross-encoder token types, padding
tokens and sequences), a BertModel whose config says is_decoder (causal attention, decided by the
configuration), and the flash kernel forced in interpret mode agreeing with the jnp path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ModelConfig
from model.layers.pooler import pool
from model.loader import load_model
from model.testing import SeqChunk, make_batch, scattered_block_tables

TINY_BERT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    type_vocab_size=2,
    hidden_act="gelu",
    initializer_range=0.2,  # BERT's 0.02 makes near-uniform class probabilities
)
NUM_LABELS = 3
# Batches of (length, second-text length) per sequence, all padded to one shape (one compilation
# per model): lengths 1 and max_position_embeddings (64) are the edges; padding tokens and
# padding sequences in most batches.
BATCHES = [
    [(1, 0)],
    [(7, 3), (2, 0), (19, 9)],
    [(64, 20)],
    [(5, 2), (1, 0), (33, 16), (12, 5), (9, 4)],
    [(30, 10), (3, 1), (64, 40), (17, 0), (2, 1), (11, 6)],
    [(16, 8)] * 8,
]
NUM_TOKENS, NUM_SEQS = 128, 8
BLOCK = 16  # ModelOptions' default block size; tables 4 blocks wide hold the longest (64)


def randomize_norms(model, seed: int) -> None:
    """LayerNorm weights around 1 and every bias small but non-zero (HF: ones and zeros), so a
    swapped norm or a dropped bias changes the output."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.rand(param.shape, generator=generator)
            if "LayerNorm.weight" in name:
                param.copy_(0.5 + noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * (noise - 0.5))


def save_tiny(directory, cls_name: str, seed: int, **overrides):
    import torch
    import transformers

    config = transformers.BertConfig(**{**TINY_BERT, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    randomize_norms(model, seed)
    model = model.eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def sequences(batch_spec, seed: int):
    """[(token ids, token types)] per sequence: [CLS] a [SEP] (b [SEP]) with random ids."""
    rng = np.random.default_rng(seed)
    out = []
    for length, second in batch_spec:
        ids = rng.integers(3, 128, size=length)
        ids[0] = 1
        types = np.zeros(length, np.int32)
        if second:
            types[length - second :] = 1
        out.append((ids.astype(np.int32), types))
    return out


def encoder_batch(seqs, num_tokens: int, num_seqs: int, max_blocks: int = 4):
    """A padded batch of whole prompts, laid out as the runner lays them: scattered block tables
    (BERT keeps no cache, but the tables' width bounds each sequence's length), token types."""
    lengths = [len(ids) for ids, _ in seqs]
    tables = scattered_block_tables(lengths, BLOCK)
    chunks = [
        SeqChunk(tuple(int(t) for t in ids), 0, table)
        for (ids, _), table in zip(seqs, tables, strict=True)
    ]
    batch = make_batch(
        chunks, BLOCK, num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=max_blocks
    )
    types = np.zeros(num_tokens, np.int32)
    types[: sum(lengths)] = np.concatenate([t for _, t in seqs])
    return batch.replace(token_type_ids=jnp.asarray(types))


def hf_run(model, seqs):
    """HF over one right-padded batch: (last hidden state per sequence, logits or None)."""
    import torch

    longest = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, (a, t) in enumerate(seqs):
        ids[i, : len(a)], types[i, : len(a)], mask[i, : len(a)] = (
            torch.from_numpy(a.astype(np.int64)),
            torch.from_numpy(t.astype(np.int64)),
            1,
        )
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True
        )
    hidden = out.hidden_states[-1].numpy()
    rows = [hidden[i, : len(a)] for i, (a, _) in enumerate(seqs)]
    logits = out.logits.numpy() if hasattr(out, "logits") else None
    return rows, logits


def step_fns(graphdef):
    forward = jax.jit(lambda state, batch: base.forward(graphdef, state, (), batch)[1])

    @jax.jit
    def probs(state, hidden, batch):
        pooled = pool(hidden, batch.cu_q_lens, batch.num_seqs, "CLS")
        return jax.nn.softmax(nnx.merge(graphdef, state).classify(pooled), axis=-1)

    return forward, probs


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert_cls")
    hf = save_tiny(path, "BertForSequenceClassification", seed=0, num_labels=NUM_LABELS)
    config = ModelConfig.from_pretrained(path, dtype="float32")
    graphdef, state = load_model(path, config)
    return path, config, hf, state, *step_fns(graphdef)


def test_classifier_probs_and_hidden_states_match_hf(classifier):
    _, config, hf, state, forward, probs = classifier
    assert (config.runner_type, config.pooling_type, config.num_labels) == ("pooling", "CLS", 3)
    worst_p = worst_h = 0.0
    for i, spec in enumerate(BATCHES):
        seqs = sequences(spec, seed=i)
        batch = encoder_batch(seqs, NUM_TOKENS, NUM_SEQS)
        hidden = forward(state, batch)
        ours_p = np.asarray(probs(state, hidden, batch))
        hf_hidden, hf_logits = hf_run(hf, seqs)
        hf_p = np.asarray(jax.nn.softmax(jnp.asarray(hf_logits), axis=-1))
        n = len(seqs)
        assert np.all(np.isfinite(ours_p))
        np.testing.assert_allclose(ours_p[:n], hf_p, atol=2e-5, err_msg=f"batch {i}")
        cu = np.asarray(batch.cu_q_lens)
        for s in range(n):
            ours_h = np.asarray(hidden[cu[s] : cu[s + 1]])
            np.testing.assert_allclose(ours_h, hf_hidden[s], atol=5e-5, err_msg=f"{i}/{s}")
            worst_h = max(worst_h, float(np.abs(ours_h - hf_hidden[s]).max()))
        worst_p = max(worst_p, float(np.abs(ours_p[:n] - hf_p).max()))
        # The classes are told apart: a parity on near-uniform probabilities would prove little.
        assert hf_p.max() - hf_p.min() > 0.05
    # Wider block tables (padding each sequence further) change nothing.
    wide = encoder_batch(seqs, NUM_TOKENS, NUM_SEQS, max_blocks=8)
    np.testing.assert_allclose(np.asarray(forward(state, wide)), np.asarray(hidden), atol=1e-6)
    print(f"max |probs - hf| {worst_p:.2e}, max |hidden - hf| {worst_h:.2e}")


def test_token_types_change_the_output(classifier):
    """A pair's second text is embedded with token type 1 (a model that dropped them would pass
    a test whose types were all 0)."""
    *_, state, forward, _ = classifier
    typed = encoder_batch(sequences([(12, 6)], seed=9), NUM_TOKENS, NUM_SEQS)
    untyped = typed.replace(token_type_ids=jnp.zeros_like(typed.token_type_ids))
    assert float(jnp.abs(forward(state, typed)[:12] - forward(state, untyped)[:12]).max()) > 1e-3


def test_flash_kernel_interpret_mode_agrees_with_reference(classifier):
    path, config, _, state, forward, _ = classifier
    flash_def, flash_state = load_model(path, config, ModelOptions(attention_backend="pallas"))
    assert [(c.impl, c.interpret) for c in nnx.merge(flash_def, flash_state).backends] == [
        ("pallas", True)
    ]
    batch = encoder_batch(sequences(BATCHES[3], seed=3), NUM_TOKENS, NUM_SEQS)
    flash = jax.jit(lambda s, b: base.forward(flash_def, s, (), b)[1])(flash_state, batch)
    used = int(batch.cu_q_lens[-1])
    np.testing.assert_allclose(
        np.asarray(flash[:used]), np.asarray(forward(state, batch)[:used]), atol=2e-5
    )


def test_is_decoder_config_attends_causally(tmp_path):
    """One class, BertModel, attends causally when its configuration says is_decoder: the
    attention type comes from the config (HF builds its mask from the same flag)."""
    hf = save_tiny(tmp_path, "BertModel", seed=1, is_decoder=True)
    config = ModelConfig.from_pretrained(tmp_path, dtype="float32")
    assert (config.attention_type, config.pooling_type) == ("causal", "LAST")
    graphdef, state = load_model(tmp_path, config)  # HF's pooler weights: ignored
    forward, _ = step_fns(graphdef)
    for i in (1, 4):
        seqs = sequences(BATCHES[i], seed=i)
        batch = encoder_batch(seqs, NUM_TOKENS, NUM_SEQS)
        hidden, cu = np.asarray(forward(state, batch)), np.asarray(batch.cu_q_lens)
        hf_hidden, _ = hf_run(hf, seqs)
        for s in range(len(seqs)):
            np.testing.assert_allclose(hidden[cu[s] : cu[s + 1]], hf_hidden[s], atol=5e-5)
    # Causal attention leaves a prefix's states unchanged when tokens are appended
    # (bidirectional attention would not).
    seqs = sequences([(10, 0)], seed=5)
    short = [(seqs[0][0][:6], seqs[0][1][:6])]
    full = np.asarray(forward(state, encoder_batch(seqs, NUM_TOKENS, NUM_SEQS)))
    prefix = np.asarray(forward(state, encoder_batch(short, NUM_TOKENS, NUM_SEQS)))
    np.testing.assert_allclose(full[:6], prefix[:6], atol=1e-5)
