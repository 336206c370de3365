"""The runner turns a cache byte budget into blocks by the sum of per-block bytes over all paged
pools, after setting aside max_num_seqs state slots (plus the scratch row) for a model with
recurrent state."""

import pytest

from model import base
from model.base import PagedCacheSpec, StateCacheSpec, paged_kv_spec
from runtime.runner import cpu_bf16
from runtime.runner.cache_budget import DEFAULT_KV_CACHE_BYTES, KVCacheSizeError, plan_cache
from runtime.runner.model_runner import cache_dtype

BLOCK = 16
KV = paged_kv_spec(num_layers=4, block_size=BLOCK, num_kv_heads=2, head_dim=64, dtype="float32")
LATENT = PagedCacheSpec("MLA latent", 4, ("latent",), (BLOCK, 1, 576), "float32")
# KDA-like: 3 layers of a [2 heads, 16, 16] f32 delta-rule state and a [3, 96] f32 conv tail.
STATE = StateCacheSpec(
    "KDA state", 3, ("recurrent", "conv"), ((2, 16, 16), (3, 96)), ("float32", "float32")
)


def num_cache_blocks(specs, max_model_len, max_num_seqs, num_kv_blocks, kv_cache_bytes):
    return plan_cache(specs, max_model_len, max_num_seqs, num_kv_blocks, kv_cache_bytes).num_blocks


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


def test_cache_dtype_on_the_cpu_is_the_hosts_choice_unless_a_kernel_is_forced():
    # The test suite runs JAX on the CPU (tests/conftest.py); runner/cpu_bf16.py chooses per host
    # (bf16 where bf16 is native and the C++ kernels built, f32 elsewhere).
    host = cpu_bf16.host_choice(64).cache_dtype
    assert host in ("float32", "bfloat16")
    assert cache_dtype("bfloat16", "auto", 64) == host
    assert cache_dtype("bfloat16", "reference", 64) == host
    assert cache_dtype("bfloat16", "pallas", 64) == "bfloat16"
    assert cache_dtype("float32", "auto", 64) == "float32"


def test_a_model_without_state_gets_no_slots():
    size = plan_cache((KV, LATENT), 256, 8, None, None)
    assert size.num_state_slots == 0 and size.state_bytes == 0
    assert size.kv_bytes == size.num_blocks * base.bytes_per_block((KV, LATENT))


def test_state_slots_are_set_aside_before_the_budget_is_divided_into_blocks():
    specs = (LATENT, STATE)
    per_block, per_slot = LATENT.bytes_per_block, STATE.bytes_per_slot
    assert per_slot == 3 * (2 * 16 * 16 * 4 + 3 * 96 * 4)
    state = (8 + 1) * per_slot  # max_num_seqs slots and the padding rows' scratch row
    budget = state + 40 * per_block + per_block // 2
    size = plan_cache(specs, 256, 8, None, budget)
    assert (size.num_blocks, size.num_state_slots, size.state_bytes) == (40, 8, state)
    assert size.kv_bytes + size.state_bytes <= budget
    # The same budget without state would have bought more blocks.
    assert num_cache_blocks((LATENT,), 256, 8, None, budget) > 40
    # The default budget still stops at max_num_seqs whole requests (8 x 16 blocks + null).
    assert plan_cache(specs, 256, 8, None, None).num_blocks == 129
    # num_kv_blocks is taken as given; the slots come on top of it.
    size = plan_cache(specs, 256, 8, 20, None)
    assert (size.num_blocks, size.num_state_slots, size.state_bytes) == (20, 8, state)
    # Allocated, the pools hold exactly the bytes planned.
    caches = base.allocate(specs, size.num_blocks, size.num_state_slots)
    assert sum(a.nbytes for entry in caches for a in entry) == size.kv_bytes + size.state_bytes


def test_max_num_seqs_beyond_the_slots_that_fit_is_refused_with_the_numbers():
    specs = (LATENT, STATE)
    per_block, per_slot = LATENT.bytes_per_block, STATE.bytes_per_slot
    one_request = 17 * per_block  # 256 tokens: 16 blocks and the null block
    budget = one_request + 5 * per_slot + per_slot // 2  # 4 slots and the scratch
    assert plan_cache(specs, 256, 4, None, budget).num_state_slots == 4
    with pytest.raises(KVCacheSizeError) as e:
        plan_cache(specs, 256, 6, None, budget)
    msg = str(e.value)
    assert (
        f"max_num_seqs=6 needs 6 state slots + 1 scratch of {per_slot} bytes each "
        f"({7 * per_slot} bytes: KDA state {per_slot} per slot)"
    ) in msg
    assert (
        f"max_model_len=256 needs 16 KV blocks of 16 tokens plus the null block ({one_request} "
        "bytes)"
    ) in msg
    assert msg.endswith(
        f"kv_cache_bytes={budget} holds only 4 state slots beside them: lower max_num_seqs to 4 "
        "or raise kv_cache_bytes"
    )
    # Not even one slot beside one request: lowering max_num_seqs cannot help.
    with pytest.raises(KVCacheSizeError, match="holds not one state slot beside them: raise"):
        plan_cache(specs, 256, 1, None, one_request + per_slot)
    # The default budget is named when it is the one that is short.
    huge = StateCacheSpec("big state", 1, ("s",), ((1 << 20,),), ("float32",))
    with pytest.raises(
        KVCacheSizeError,
        match=f"the default cache budget of {DEFAULT_KV_CACHE_BYTES} bytes holds only 510 state",
    ):
        plan_cache((LATENT, huge), 256, 600, None, None)
