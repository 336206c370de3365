"""ragged_paged_attention with prefix_lens (PaliGemma's prefix LM) against a per-token numpy oracle:
sequence s's first prefix_lens[s] positions attend each other both ways, the rest causally, over
cached pages and this step's tokens alike; pages a token must not read are NaN-poisoned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from rpa_cases import make_batch

from pallas_kernels import ragged_paged_attention as rpa

# (query tokens this step, context length, prefix length), each a named scenario.
CASES = {
    "whole prompt is the prefix": (25, 25, 25),
    "prefix then a causal suffix in one step": (40, 40, 12),
    "decode after the prefix": (1, 30, 16),
    "last tokens of a prefix whose first blocks are cached": (5, 24, 24),
    "suffix tokens after a cached prefix": (6, 26, 20),
    "no prefix (causal)": (7, 7, 0),
    "prefix of one token": (9, 9, 1),
}


def _oracle(b, prefix, *, sm_scale):
    q = np.asarray(b["q"], np.float64)
    kc, vc = np.asarray(b["k_cache"], np.float64), np.asarray(b["v_cache"], np.float64)
    t, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = np.zeros((t, hq, d))
    cu = b["cu_q_lens"]
    for s in range(int(b["num_seqs"])):
        kl, ql = int(b["kv_lens"][s]), int(cu[s + 1] - cu[s])
        for i in range(ql):
            tok, qpos = int(cu[s]) + i, kl - ql + i
            keys = range(max(qpos, prefix[s] - 1) + 1)
            for h in range(hq):
                page = [(b["block_tables"][s, p // bs], p % bs, h // (hq // hkv)) for p in keys]
                ks = np.stack([kc[a] for a in page])
                vs = np.stack([vc[a] for a in page])
                w = np.exp(ks @ q[tok, h] * sm_scale - (ks @ q[tok, h] * sm_scale).max())
                out[tok, h] = (w / w.sum()) @ vs
    return out


def test_prefix_lm_matches_the_oracle():
    rng = np.random.default_rng(0)
    names = list(CASES)
    q_lens, kv_lens, prefix = zip(*CASES.values(), strict=True)
    b = make_batch(
        rng, q_lens, kv_lens, hq=4, hkv=2, d=16, block_size=4, max_blocks=12, pad_tokens=3,
        pad_seqs=1,
    )  # fmt: skip
    lens = np.zeros(len(names) + 1, np.int32)
    lens[: len(names)] = prefix
    fn = jax.jit(lambda b, p: rpa.ragged_paged_attention(**b, prefix_lens=p, sm_scale=0.25))
    got = np.asarray(fn({k: jnp.asarray(v) for k, v in b.items()}, jnp.asarray(lens)))
    want = _oracle(b, lens, sm_scale=0.25)
    cu = b["cu_q_lens"]
    failed = [
        f"{name}: max diff {np.abs(got[cu[s] : cu[s + 1]] - want[cu[s] : cu[s + 1]]).max()}"
        for s, name in enumerate(names)
        if not np.allclose(got[cu[s] : cu[s + 1]], want[cu[s] : cu[s + 1]], atol=2e-5)
    ]
    assert not failed, "\n".join(failed)
    # The prefix really changes the result where it reaches past a token's own position.
    causal = np.asarray(
        jax.jit(lambda b: rpa.ragged_paged_attention(**b, sm_scale=0.25))(
            {k: jnp.asarray(v) for k, v in b.items()}
        )
    )
    s = names.index("prefix then a causal suffix in one step")
    rows = slice(cu[s], cu[s] + 11)  # prefix rows before its last
    assert np.abs(causal[rows] - got[rows]).max() > 1e-3
    suffix = slice(cu[s] + 12, cu[s + 1])
    np.testing.assert_allclose(causal[suffix], got[suffix], atol=2e-5)
