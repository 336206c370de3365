"""model/registry.py: families from outside the project join, and are checked against the protocol."""

import pytest

from model import registry


def test_a_registered_class_without_the_protocol_is_refused_by_name():
    class NotAFamily:
        @classmethod
        def hf_weight_specs(cls, config):
            return ()

    registry.register("NotAFamilyForCausalLM", NotAFamily, ("generate",))
    try:
        with pytest.raises(TypeError, match="NotAFamily.*lacks hf_ignored_weight, cache_specs"):
            registry.model_class("NotAFamilyForCausalLM")
        with pytest.raises(ValueError, match="already registered"):
            registry.register("NotAFamilyForCausalLM", "x.y:Z", ("generate",))
    finally:
        registry.unregister("NotAFamilyForCausalLM")
    with pytest.raises(ValueError, match="built in"):
        registry.unregister("LlamaForCausalLM")
    with pytest.raises(ValueError, match="runner_types must be"):
        registry.register("X", "x.y:Z", ("decode",))
