"""Helpers for tests (of model/ and of other packages): tiny random HF checkpoints, the HF
transformers oracle, and hand-built paged batches.

torch and transformers are imported inside the functions so model/ never needs them at import time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from model.batch import ModelBatch

# The tiny shape every architecture starts from (see shared/reference/environment.md §2);
# initializer_range is raised from HF's 0.02 so greedy argmaxes are not near-ties.
TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)
# MLA + MoE on top of TINY_COMMON (shared/reference/environment.md §2). initializer_range 0.3: with
# random weights DeepSeek's logits are otherwise close to flat and greedy choices near-ties.
DEEPSEEK_TINY = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    initializer_range=0.3,
)
# Kimi-Linear on TINY_COMMON: KDA, MLA (no rope; latent 16 + 16 = 32, a head dim the Pallas paged
# attention serves too), KDA; a dense first layer, then MoE with a shared expert.
KIMI_TINY = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_experts=4,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
    initializer_range=0.3,
)
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_TINY),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", KIMI_TINY),
}


def write_tiny_checkpoint(
    directory: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides,
) -> str:
    """Save a random-weight HF model of `arch` ("llama" | "qwen2" | "qwen3" | "deepseek_v3" |
    "kimi_linear") as safetensors."""
    import torch
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {sorted(_ARCHS)}")
    config_name, model_name, arch_defaults = _ARCHS[arch]
    config = getattr(transformers, config_name)(**{**TINY_COMMON, **arch_defaults, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    randomize_constant_parameters(model, seed)
    randomize_routing_biases(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(os.fspath(directory), safe_serialization=True)
    return os.fspath(directory)


def randomize_constant_parameters(model, seed: int) -> list[str]:
    """Give random values to every parameter HF initializes to one constant (norm weights at 1,
    biases at 0), in place; returns their names.

    With constant norm weights, swapping two norms (`input_layernorm` for
    `post_attention_layernorm`, q_norm for k_norm) or dropping a norm's scale computes the same
    function, and a parity test cannot see it; the same goes for a bias added twice or not at all.
    Norm weights stay positive around 1 and biases small, so logits keep clear greedy gaps.
    """
    import torch

    generator = torch.Generator().manual_seed(seed + 7919)
    changed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().flatten()
            if flat.numel() > 1 and not bool((flat == flat[0]).all()):
                continue
            noise = torch.rand(param.shape, generator=generator, dtype=torch.float32)
            # norms uniform in [0.5, 1.5), biases uniform in [-0.1, 0.1)
            value = 0.5 + noise if "norm" in name else 0.2 * (noise - 0.5)
            param.copy_(value.to(param.dtype))
            changed.append(name)
    return changed


def randomize_routing_biases(model, seed: int) -> list[str]:
    """Give DeepSeek's `e_score_correction_bias` buffers (zeros at init, and not parameters)
    values in [-0.1, 0.1), in place, so a router that ignores or misapplies them routes differently;
    returns their names."""
    import torch

    generator = torch.Generator().manual_seed(seed + 104729)
    changed = []
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                noise = torch.rand(buf.shape, generator=generator, dtype=torch.float32)
                buf.copy_((0.2 * (noise - 0.5)).to(buf.dtype))
                changed.append(name)
    return changed


def hf_load(path: str, dtype: str = "float32"):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.eval()


def hf_logits(model, token_ids: Sequence[int]) -> np.ndarray:
    """HF's f32 logits [len(token_ids), vocab] from one full forward over the tokens."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]))
    return out.logits[0].float().numpy()


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """HF `generate(do_sample=False)`'s new tokens, never stopping early at EOS."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


def hf_greedy_logprobs(model, prompt: Sequence[int], max_new_tokens: int, k: int = 5):
    """HF's greedy new tokens and, per position, its top-`k` {token: logprob} (from one full
    forward over prompt + tokens): the HF side of `check_logprobs_close`."""
    tokens = hf_greedy(model, prompt, max_new_tokens)
    logits = hf_logits(model, list(prompt) + tokens)[len(prompt) - 1 : -1]
    lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    top = np.argsort(-lp, axis=-1)[:, :k]
    return tokens, [{int(t): float(lp[i, t]) for t in top[i]} for i in range(len(tokens))]


def check_logprobs_close(ours, theirs, atol: float) -> None:
    """vLLM's rule for greedy outputs [(token ids, [{token: logprob} per position])]: where the
    ids diverge, each side's token must be in the other's top-k, and the comparison stops there;
    where they agree, the logprobs of the tokens both list must be within `atol`."""
    for (ids_a, lps_a), (ids_b, lps_b) in zip(ours, theirs, strict=True):
        for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=True)):
            if a != b:
                assert a in lps_b[i] and b in lps_a[i], f"position {i}: {a} vs {b}"
                break
            for tok, lp in lps_b[i].items():
                if tok in lps_a[i]:
                    assert abs(lps_a[i][tok] - lp) < atol, (i, tok, lps_a[i][tok], lp)


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's scheduled tokens this step: `tokens` at positions start, start+1, ..."""

    tokens: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]


def make_batch(
    chunks: Sequence[SeqChunk],
    block_size: int,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_blocks: int | None = None,
    state_slots: Sequence[int] | None = None,
    state_reset: Sequence[bool] | None = None,
    scratch_slot: int = 0,
) -> ModelBatch:
    """A padded ModelBatch (logits wanted for every sequence's last token), laid out like the
    runner's: padding tokens have slot -1, padding sequences kv_len 0 and an all-zero table.

    For models with recurrent state, `state_slots` / `state_reset` give each chunk's state slot and
    whether it starts from zero; padding rows get `scratch_slot` (the pools' last row) and no reset.
    """
    t = sum(len(c.tokens) for c in chunks)
    num_tokens = t if num_tokens is None else num_tokens
    num_seqs = len(chunks) if num_seqs is None else num_seqs
    max_blocks = max(len(c.block_table) for c in chunks) if max_blocks is None else max_blocks
    if num_tokens < t or num_seqs < len(chunks):
        raise ValueError(
            f"batch of {t} tokens / {len(chunks)} seqs exceeds {num_tokens} / {num_seqs}"
        )
    ids = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    logits_idx = np.zeros(num_seqs, np.int32)
    off = 0
    for s, c in enumerate(chunks):
        n, end = len(c.tokens), c.start + len(c.tokens)
        if -(-end // block_size) > len(c.block_table):
            raise ValueError(
                f"sequence {s} reaches position {end} beyond its {len(c.block_table)} blocks"
            )
        p = np.arange(c.start, end)
        ids[off : off + n] = c.tokens
        pos[off : off + n] = p
        slots[off : off + n] = (
            np.asarray(c.block_table)[p // block_size] * block_size + p % block_size
        )
        tables[s, : len(c.block_table)] = c.block_table
        kv_lens[s] = end
        off += n
        cu[s + 1] = off
        logits_idx[s] = off - 1
    cu[len(chunks) + 1 :] = off
    state = {}
    if state_slots is not None:
        if len(state_slots) != len(chunks) or len(state_reset or ()) != len(chunks):
            raise ValueError(
                f"state_slots {state_slots} and state_reset {state_reset} need one entry per "
                f"chunk ({len(chunks)})"
            )
        rows = np.full(num_seqs, scratch_slot, np.int32)
        rows[: len(chunks)] = state_slots
        reset = np.zeros(num_seqs, bool)
        reset[: len(chunks)] = state_reset
        state = dict(state_slots=jnp.asarray(rows), state_reset=jnp.asarray(reset))
    return ModelBatch(
        token_ids=jnp.asarray(ids),
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(kv_lens),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray(len(chunks), jnp.int32),
        logits_indices=jnp.asarray(logits_idx),
        **state,
    )


def scattered_block_tables(
    lengths: Sequence[int], block_size: int, seed: int = 0
) -> list[tuple[int, ...]]:
    """Disjoint, non-contiguous block tables covering each length (block 0 left unused, as the
    runner pads tables with 0)."""
    need = [-(-n // block_size) for n in lengths]
    ids = np.random.default_rng(seed).permutation(np.arange(1, sum(need) + 1))
    out, i = [], 0
    for k in need:
        out.append(tuple(int(b) for b in ids[i : i + k]))
        i += k
    return out


def run_schedule(
    forward,
    logits,
    graphdef,
    state,
    caches,
    tokens: dict[str, Sequence[int]],
    tables: dict[str, tuple[int, ...]],
    steps: Sequence[Sequence[tuple[str, int, int]]],
    block_size: int,
    **shape,
):
    """Runs a hand-made schedule, one batch per step of (seq, start, end) chunks, through the
    jitted `forward(graphdef, state, caches, batch)` and `logits(graphdef, state, hidden)`;
    returns (caches, {seq: {position: logits row}}) for every token computed. `shape` pads every
    batch alike (num_tokens, num_seqs, max_blocks) so the step compiles once."""
    got: dict[str, dict[int, np.ndarray]] = {}
    for step in steps:
        chunks = [SeqChunk(tuple(tokens[s][a:b]), a, tables[s]) for s, a, b in step]
        caches, hidden = forward(graphdef, state, caches, make_batch(chunks, block_size, **shape))
        rows = iter(np.asarray(logits(graphdef, state, hidden)))
        for s, a, b in step:
            for p in range(a, b):
                got.setdefault(s, {})[p] = next(rows)
    return caches, got
