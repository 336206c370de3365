"""The runner turns a KV cache byte budget into blocks by the sum of per-block bytes over all pools."""

import pytest

from model import base
from model.base import PagedCacheSpec, paged_kv_spec
from runtime.runner.model_runner import KVCacheSizeError, cache_dtype, num_cache_blocks

BLOCK = 16
KV = paged_kv_spec(num_layers=4, block_size=BLOCK, num_kv_heads=2, head_dim=64, dtype="float32")
LATENT = PagedCacheSpec("MLA latent", 4, ("latent",), (BLOCK, 1, 576), "float32")


def test_budget_is_divided_by_the_bytes_of_every_pool():
    per_block = KV.bytes_per_block + LATENT.bytes_per_block
    budget = 100 * per_block + per_block // 2  # a part block is not a block
    blocks = num_cache_blocks((KV, LATENT), 256, 8, None, budget)
    assert blocks == 100
    # Counting only the first pool would have given more blocks than the budget pays for.
    assert num_cache_blocks((KV,), 256, 8, None, budget) > blocks
    assert blocks * base.bytes_per_block((KV, LATENT)) <= budget


def test_default_budget_stops_at_what_max_num_seqs_full_requests_need():
    # 2 sequences x 256 tokens / 16 = 32 blocks, plus the null block; the 2 GiB default pays more.
    assert num_cache_blocks((KV, LATENT), 256, 2, None, None) == 33
    assert num_cache_blocks((KV, LATENT), 256, 2, 40, None) == 40  # given as is


def test_a_budget_below_one_request_names_every_pool():
    per_block = KV.bytes_per_block + LATENT.bytes_per_block
    with pytest.raises(KVCacheSizeError) as e:
        num_cache_blocks((KV, LATENT), 256, 2, None, 10 * per_block)
    msg = str(e.value)
    assert "max_model_len=256 needs 16 KV blocks" in msg
    assert f"{per_block} bytes per block: attention K/V {KV.bytes_per_block}" in msg
    assert f"MLA latent {LATENT.bytes_per_block}" in msg


def test_cache_dtype_keeps_bf16_caches_in_f32_on_the_cpu_unless_a_kernel_is_forced():
    # The test suite runs JAX on the CPU (tests/conftest.py).
    assert cache_dtype("bfloat16", "auto") == "float32"
    assert cache_dtype("bfloat16", "reference") == "float32"
    assert cache_dtype("bfloat16", "pallas") == "bfloat16"
    assert cache_dtype("float32", "auto") == "float32"
