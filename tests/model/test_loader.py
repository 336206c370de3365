"""safetensors loading: by on-disk HF names, single file and sharded, errors naming every tensor."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from model import base
from model.config import ConfigError, ModelConfig
from model.loader import LoadError, load_model
from model.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama") / "ck", "llama")


def _rewrite(src, dst, tensors):
    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{src}/{f}", dst / f)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def _load(path, **kw):
    return load_model(path, ModelConfig.from_pretrained(path, **{"dtype": "float32", **kw}))


def _flat(state):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def test_loads_by_hf_names_with_fused_projections(ckpt):
    disk = load_file(f"{ckpt}/model.safetensors")
    _, state = _load(ckpt)
    flat = _flat(state)
    attn = "model.layers.1.self_attn."
    qkv = np.concatenate([disk[attn + f"{n}_proj.weight"] for n in "qkv"], axis=0)
    np.testing.assert_array_equal(
        flat[("model", "layers", 1, "self_attn", "qkv_proj", "weight")], qkv
    )
    mlp = "model.layers.0.mlp."
    gate_up = np.concatenate([disk[mlp + "gate_proj.weight"], disk[mlp + "up_proj.weight"]], 0)
    np.testing.assert_array_equal(
        flat[("model", "layers", 0, "mlp", "gate_up_proj", "weight")], gate_up
    )
    np.testing.assert_array_equal(flat[("lm_head", "weight")], disk["lm_head.weight"])
    assert all(a.dtype == np.float32 for a in flat.values())


def test_missing_unexpected_and_misshaped_are_all_named(ckpt, tmp_path):
    t = load_file(f"{ckpt}/model.safetensors")
    cases = {
        "missing": dict(drop=["model.layers.1.mlp.up_proj.weight"]),
        "unexpected": dict(add={"model.layers.0.self_attn.extra.weight": np.ones(3, np.float32)}),
        "mis-shaped": dict(add={"model.norm.weight": np.ones(65, np.float32)}),
    }
    for kind, change in cases.items():
        bad = {k: v for k, v in t.items() if k not in change.get("drop", ())} | change.get(
            "add", {}
        )
        with pytest.raises(LoadError) as e:
            _load(_rewrite(ckpt, tmp_path / kind.replace("-", ""), bad))
        msg = str(e.value)
        assert f"{kind} tensors" in msg, msg
        assert all(n in msg for n in change.get("drop", ()) or change["add"]), msg
    # all three at once: one error naming each
    everything = {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"}
    everything |= {
        "extra.bias": np.ones(2, np.float32),
        "model.norm.weight": np.ones(65, np.float32),
    }
    with pytest.raises(LoadError) as e:
        _load(_rewrite(ckpt, tmp_path / "all", everything))
    msg = str(e.value)
    for part in ("model.layers.1.mlp.up_proj.weight", "extra.bias", "expected (64,), found (65,)"):
        assert part in msg, msg


def test_sharded_checkpoint_loads_the_same_weights(ckpt, tmp_path):
    t = load_file(f"{ckpt}/model.safetensors")
    names = sorted(t)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(f"{ckpt}/config.json", out / "config.json")
    for file, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(out / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    single, sharded = _flat(_load(ckpt)[1]), _flat(_load(str(out))[1])
    assert single.keys() == sharded.keys()
    for p in single:
        np.testing.assert_array_equal(single[p], sharded[p])
    # an index naming a shard that is not there
    weight_map["model.norm.weight"] = "model-00003-of-00002.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(LoadError, match="model-00003-of-00002.safetensors"):
        _load(str(out))


def test_no_weights_is_a_clear_error(ckpt, tmp_path):
    shutil.copy(f"{ckpt}/config.json", tmp_path / "config.json")
    with pytest.raises(LoadError, match="no model.safetensors"):
        _load(str(tmp_path))


def test_tied_embeddings_share_the_embedding_table(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    t = load_file(f"{path}/model.safetensors")
    assert "lm_head.weight" not in t
    graphdef, state = _load(path)
    assert all(p[0] != "lm_head" for p, _ in nnx.to_flat_state(state))
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64), np.float32))
    got = base.compute_logits(graphdef, state, hidden)
    np.testing.assert_allclose(got, hidden @ t["model.embed_tokens.weight"].T, rtol=1e-5, atol=1e-5)
    # an exporter that also stored the (tied) head: accepted and unused
    dup = _rewrite(path, tmp_path / "dup", t | {"lm_head.weight": np.zeros((128, 64), np.float32)})
    np.testing.assert_allclose(base.compute_logits(*_load(dup), hidden), got)


def test_bfloat16_tensors_load_exactly(tmp_path):
    import torch
    from safetensors.torch import load_file as torch_load

    path = write_tiny_checkpoint(tmp_path / "bf16", "qwen2", dtype="bfloat16")
    want = torch_load(f"{path}/model.safetensors")
    for dtype, np_dtype in (("auto", jnp.bfloat16), ("float32", np.float32)):
        flat = _flat(_load(path, dtype=dtype)[1])
        bias = flat[("model", "layers", 0, "self_attn", "qkv_proj", "bias")]
        assert bias.dtype == np_dtype
        q_bias = want["model.layers.0.self_attn.q_proj.bias"].to(torch.float32).numpy()
        np.testing.assert_array_equal(bias[: q_bias.shape[0]].astype(np.float32), q_bias)


def test_fp8_tensors_are_refused_naming_them(ckpt, tmp_path):
    """An FP8 checkpoint (DeepSeek-V3's release: F8_E4M3 weights beside weight_scale_inv scales)
    is refused by its tensors' dtype, not reported as a list of unexpected scale tensors."""
    import torch
    from safetensors.torch import load_file as torch_load
    from safetensors.torch import save_file as torch_save

    tensors = torch_load(f"{ckpt}/model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    dst = tmp_path / "fp8"
    dst.mkdir()
    shutil.copy(f"{ckpt}/config.json", dst / "config.json")
    torch_save(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        _load(str(dst))
    message = str(e.value)
    assert f"1 tensors are stored as F8_E4M3, e.g. {name} (F8_E4M3)" in message
    assert "no dequantization path" in message and "unexpected" not in message
