import logging

import jax.numpy as jnp
import pytest

from pallas_kernels import backends
from pallas_kernels.backends import BackendError, Implementation


@pytest.fixture
def toy_op():
    op = "toy_op_for_tests"
    backends.register(
        Implementation(
            op,
            "reference",
            fn=lambda: "ref",
            priority=0,
            platforms=frozenset({"cpu", "cuda", "rocm"}),
            features=frozenset({"ragged", "soft_cap"}),
        )
    )
    backends.register(
        Implementation(
            op,
            "pallas",
            fn=lambda: "pallas",
            priority=10,
            platforms=frozenset({"cuda", "rocm"}),
            interpret_platforms=frozenset({"cpu"}),
            dtypes=frozenset({"float32", "bfloat16"}),
            head_dims=frozenset({64, 128}),
            features=frozenset({"ragged"}),
        )
    )
    yield op
    del backends._REGISTRY[op]


def test_gpu_prefers_pallas(toy_op):
    c = backends.select(toy_op, platform="cuda", dtype=jnp.bfloat16, head_dim=128)
    assert c.impl == "pallas" and not c.interpret and c.rejected == ()


def test_cpu_default_is_reference_with_reason(toy_op):
    c = backends.select(toy_op, platform="cpu", dtype=jnp.float32, head_dim=128)
    assert c.impl == "reference"
    assert c.rejected[0][0] == "pallas" and "platform 'cpu'" in c.rejected[0][1]


def test_forced_pallas_on_cpu_runs_in_interpret_mode(toy_op):
    c = backends.select(toy_op, impl="pallas", platform="cpu", dtype=jnp.float32, head_dim=64)
    assert c.impl == "pallas" and c.interpret


def test_every_argument_is_checked(toy_op):
    c = backends.select(toy_op, platform="rocm", dtype=jnp.float32, head_dim=256)
    assert c.impl == "reference" and "head_dim 256" in c.rejected[0][1]
    c = backends.select(toy_op, platform="rocm", dtype=jnp.float16, head_dim=64)
    assert c.impl == "reference" and "dtype float16" in c.rejected[0][1]
    c = backends.select(toy_op, platform="cuda", head_dim=64, features={"ragged", "soft_cap"})
    assert c.impl == "reference" and "soft_cap" in c.rejected[0][1]


def test_forcing_an_ineligible_impl_raises_with_reason(toy_op):
    with pytest.raises(BackendError, match="head_dim 256"):
        backends.select(toy_op, impl="pallas", platform="cuda", head_dim=256)
    with pytest.raises(BackendError, match="unknown implementation 'triton'"):
        backends.select(toy_op, impl="triton", platform="cuda")


def test_no_eligible_impl_names_every_reason(toy_op):
    with pytest.raises(BackendError, match="pallas: .*sinks.*reference: .*sinks"):
        backends.select(toy_op, platform="cuda", features={"sinks"})


def test_unknown_op():
    with pytest.raises(BackendError, match="unknown op"):
        backends.select("no_such_op")


def test_every_decision_is_logged_with_its_reason(toy_op, caplog):
    with caplog.at_level(logging.INFO, logger="pallas_kernels.backends"):
        backends.select(toy_op, platform="cpu", dtype=jnp.float32, head_dim=128)
        backends.select(toy_op, impl="pallas", platform="cpu", dtype=jnp.float32, head_dim=64)
        backends.select(toy_op, platform="cuda", dtype=jnp.float32, head_dim=64)
    assert [r.getMessage() for r in caplog.records] == [
        f"backend: {toy_op} -> reference [rejected pallas: platform 'cpu' not served "
        "(serves ['cuda', 'rocm'])]",
        f"backend: {toy_op} -> pallas (interpret mode) [forced by configuration]",
        f"backend: {toy_op} -> pallas [the preferred implementation]",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_a_choice_made_earlier_is_confirmed_not_decided_again(toy_op, caplog):
    choice = backends.select(toy_op, impl="pallas", platform="cpu", dtype=jnp.float32, head_dim=64)
    with caplog.at_level(logging.DEBUG, logger="pallas_kernels.backends"):
        again = backends.select(toy_op, impl=choice, platform="cpu", dtype=jnp.float32, head_dim=64)
    assert again is choice and caplog.records == []
    with pytest.raises(
        BackendError, match="'pallas', chosen when the model was built, .*head_dim 256"
    ):
        backends.select(toy_op, impl=choice, platform="cpu", head_dim=256)
    with pytest.raises(BackendError, match="choice made for another op"):
        backends.select("ragged_paged_attention", impl=choice, platform="cpu")
    # A choice that runs natively does not slip into interpret mode on another platform.
    native = backends.select(toy_op, platform="cuda", dtype=jnp.float32, head_dim=64)
    assert native.impl == "pallas" and not native.interpret
    with pytest.raises(BackendError, match="platform 'cpu' not served"):
        backends.select(toy_op, impl=native, platform="cpu", head_dim=64)
