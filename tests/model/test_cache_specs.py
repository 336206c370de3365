"""Cache specs (model/base.py): per-block bytes, the flat cache value, and pools of several kinds."""

import jax.numpy as jnp
import pytest

from model import base
from model.base import ModelOptions, PagedCacheSpec, paged_kv_spec

BLOCK = 16


def _pools():
    """Pools of the kinds DeepSeek-V3.2 will declare beside a Llama-style K/V pool."""
    kv = paged_kv_spec(
        num_layers=3, block_size=BLOCK, num_kv_heads=2, head_dim=64, dtype="bfloat16"
    )
    # MLA latent: one shared "head" of kv_lora_rank + qk_rope_head_dim = 512 + 64.
    latent = PagedCacheSpec("MLA latent", 2, ("latent",), (BLOCK, 1, 576), "bfloat16")
    # DSA indexer keys: index_head_dim 128, kept in f32 here to mix dtypes.
    keys = PagedCacheSpec("indexer keys", 2, ("keys",), (BLOCK, 128), "float32")
    return kv, latent, keys


def test_per_block_bytes_of_each_kind():
    kv, latent, keys = _pools()
    assert kv.bytes_per_block == 3 * 2 * (BLOCK * 2 * 64) * 2  # layers x (k, v) x page x bf16
    assert latent.bytes_per_block == 2 * 1 * (BLOCK * 576) * 2
    assert keys.bytes_per_block == 2 * 1 * (BLOCK * 128) * 4
    assert base.bytes_per_block(_pools()) == (
        kv.bytes_per_block + latent.bytes_per_block + keys.bytes_per_block
    )


def test_allocated_cache_is_one_entry_per_layer_with_the_stated_bytes():
    specs = _pools()
    caches = base.allocate(specs, num_blocks=5)
    assert len(caches) == 3 + 2 + 2
    assert [len(entry) for entry in caches] == [2, 2, 2, 1, 1, 1, 1]
    assert all(a.shape[0] == 5 for entry in caches for a in entry)  # block axis first
    assert caches[3][0].shape == (5, BLOCK, 1, 576) and caches[5][0].dtype == jnp.float32
    assert sum(a.nbytes for entry in caches for a in entry) == 5 * base.bytes_per_block(specs)
    kv, latent, keys = base.split_caches(specs, caches)
    assert (len(kv), len(latent), len(keys)) == (3, 2, 2)
    assert kv[2] is caches[2] and keys[0] is caches[5]
    with pytest.raises(ValueError, match="got 6 cache entries for 7 layers"):
        base.split_caches(specs, caches[:-1])


def test_log_line_names_each_pool_and_its_bytes():
    kv, latent, keys = _pools()
    line = base.describe(_pools(), num_blocks=10)
    total = 10 * base.bytes_per_block(_pools())
    assert line.startswith(f"10 blocks of {BLOCK} tokens, {total} bytes")
    for spec in (kv, latent, keys):
        assert f"{spec.name} {10 * spec.bytes_per_block} bytes" in line


def test_pools_must_share_one_block_size():
    kv, _, _ = _pools()
    other = paged_kv_spec(1, BLOCK * 2, 2, 64, "bfloat16", name="wide K/V")
    with pytest.raises(ValueError, match="one block size.*attention K/V: 16, wide K/V: 32"):
        base.bytes_per_block((kv, other))
    with pytest.raises(ValueError, match="at least one cache spec"):
        base.bytes_per_block(())


def test_bad_specs_and_options_name_the_value():
    with pytest.raises(ValueError, match="dtype must be a dtype name.*'f32'"):
        PagedCacheSpec("x", 1, ("k",), (BLOCK, 4), "f32")
    with pytest.raises(ValueError, match=r"page_shape must be positive ints, got \(16, 0\)"):
        PagedCacheSpec("x", 1, ("k",), (BLOCK, 0), "float32")
    with pytest.raises(ValueError, match="num_layers=0"):
        PagedCacheSpec("x", 0, ("k",), (BLOCK, 4), "float32")
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        ModelOptions(block_size=0)
    with pytest.raises(ValueError, match="cache_dtype must be a dtype name.*'half'"):
        ModelOptions(cache_dtype="half")


def _kda_state(layers=3):
    """A KDA-like state pool: a float32 delta-rule state and a bfloat16 conv tail per slot."""
    return base.StateCacheSpec(
        "KDA state", layers, ("recurrent", "conv"), ((2, 16, 16), (3, 96)), ("float32", "bfloat16")
    )


def test_state_spec_bytes_allocation_and_flat_order():
    kv, latent, _ = _pools()
    state = _kda_state()
    assert state.bytes_per_slot == 3 * (2 * 16 * 16 * 4 + 3 * 96 * 2)
    specs = (latent, state, kv)  # state pools sit in spec order like any other pool
    assert base.state_specs(specs) == (state,) and base.has_state(specs)
    assert base.state_specs(_pools()) == () and not base.has_state(_pools())
    assert base.bytes_per_block(specs) == latent.bytes_per_block + kv.bytes_per_block
    assert base.bytes_per_slot(specs) == state.bytes_per_slot and base.bytes_per_slot(_pools()) == 0
    caches = base.allocate(specs, num_blocks=5, num_slots=4)
    assert len(caches) == 2 + 3 + 3
    lat, st, kvs = base.split_caches(specs, caches)
    assert lat[0][0].shape == (5, BLOCK, 1, 576) and kvs[2][1].shape == (5, BLOCK, 2, 64)
    # num_slots + 1 rows: the last is the scratch slot of padding rows
    assert [a.shape for a in st[1]] == [(5, 2, 16, 16), (5, 3, 96)]
    assert [a.dtype for a in st[1]] == [jnp.float32, jnp.bfloat16]
    assert sum(a.nbytes for entry in st for a in entry) == 5 * base.bytes_per_slot(specs)
    assert base.allocate(specs, num_blocks=5)[2][0].shape == (
        1,
        2,
        16,
        16,
    )  # no slots: scratch only
    line = base.describe(specs, num_blocks=10, num_slots=4)
    total = 10 * base.bytes_per_block(specs) + 5 * state.bytes_per_slot
    assert line.startswith(
        f"10 blocks of {BLOCK} tokens and 4 state slots of {state.bytes_per_slot} bytes, {total} "
    )
    assert f"KDA state {5 * state.bytes_per_slot} bytes" in line
    assert f"(4 slots + 1 scratch of {state.bytes_per_slot} bytes; 3 layers x recurrent" in line
    with pytest.raises(ValueError, match="at least one cache spec that is paged, got KDA state"):
        base.bytes_per_block((state,))


def test_bad_state_specs_name_the_value():
    with pytest.raises(ValueError, match="one shape and one dtype per part"):
        base.StateCacheSpec("s", 1, ("a", "b"), ((2,),), ("float32", "float32"))
    with pytest.raises(
        ValueError, match=r"part 'a' shape must be a tuple of positive ints, got \(2, 0\)"
    ):
        base.StateCacheSpec("s", 1, ("a",), ((2, 0),), ("float32",))
    with pytest.raises(ValueError, match="part 'a' dtype must be a dtype name.*'f32'"):
        base.StateCacheSpec("s", 1, ("a",), ((2,),), ("f32",))
    with pytest.raises(ValueError, match="num_layers=0"):
        base.StateCacheSpec("s", 0, ("a",), ((2,),), ("float32",))
    with pytest.raises(ValueError, match="num_slots must be >= 0, got -1"):
        _kda_state().allocate(-1)
