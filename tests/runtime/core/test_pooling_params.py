"""PoolingParams: vLLM's fields, defaults per task and refusals, with vLLM's messages."""

import pytest

from runtime.core.request import PoolingParams


def test_defaults_per_task():
    embed = PoolingParams().verify("embed", model="m")
    assert (embed.task, embed.normalize, embed.use_activation) == ("embed", True, None)
    assert embed.skip_reading_prefix_cache is False
    # A sentence-transformers model without a Normalize module does not normalize by default.
    assert PoolingParams().verify("embed", model="m", default_normalize=False).normalize is False
    assert (
        PoolingParams(normalize=True).verify("embed", model="m", default_normalize=False).normalize
    )
    classify = PoolingParams().verify("classify", model="m")
    assert (classify.use_activation, classify.normalize) == (True, None)
    assert PoolingParams(use_activation=False).verify("score", model="m").use_activation is False
    tokens = PoolingParams().verify("token_embed", model="m")
    assert tokens.normalize is True and tokens.skip_reading_prefix_cache is True
    # Verified values verify again for the same task, unchanged.
    assert embed.verify("embed", model="m") == embed


def test_activation_is_the_old_name_of_use_activation():
    assert PoolingParams(activation=False).use_activation is False
    assert PoolingParams(activation=True, use_activation=True).use_activation is True
    with pytest.raises(ValueError, match="the same as use_activation=True"):
        PoolingParams(activation=False, use_activation=True)


def test_use_activation_is_the_normalize_switch_of_embedding_tasks():
    """vLLM 0.33's PoolingParams has no `normalize`: for embed and token_embed its
    use_activation (and so the older `activation`) decides normalization."""
    for task in ("embed", "token_embed"):
        for value in (False, True):
            for given in (dict(use_activation=value), dict(activation=value)):
                assert PoolingParams(**given).verify(task, model="m").normalize is value
        both = PoolingParams(use_activation=False, normalize=False).verify(task, model="m")
        assert both.normalize is False
        with pytest.raises(ValueError, match="use_activation=True: expected the same as normalize"):
            PoolingParams(use_activation=True, normalize=False).verify(task, model="m")


def test_a_task_refuses_the_parameters_of_another():
    with pytest.raises(ValueError) as err:
        PoolingParams(normalize=True).verify("score", model="m")
    assert str(err.value) == (
        "Task score only supports ['use_activation'] parameters, does not support "
        "['normalize'] parameters"
    )
    with pytest.raises(ValueError, match=r"Task classify only supports \['use_activation'\]"):
        PoolingParams(normalize=False, dimensions=8).verify("classify", model="m")
    with pytest.raises(
        ValueError, match="You cannot overwrite self.task='embed' with task='score'"
    ):
        PoolingParams().verify("embed", model="m").verify("score", model="m")
    with pytest.raises(ValueError, match="unknown pooling task 'generate'"):
        PoolingParams().verify("generate", model="m")


def test_dimensions_need_a_matryoshka_model():
    with pytest.raises(ValueError, match='Model "mini" does not support matryoshka'):
        PoolingParams(dimensions=8).verify("embed", model="mini")
    ok = PoolingParams(dimensions=8).verify("embed", model="q", is_matryoshka=True, hidden_size=64)
    assert ok.dimensions == 8
    with pytest.raises(ValueError, match="64-dimensional embeddings; expected 1..64"):
        PoolingParams(dimensions=65).verify("embed", model="q", is_matryoshka=True, hidden_size=64)
    listed = dict(model="q", is_matryoshka=True, matryoshka_dimensions=(16, 32))
    assert PoolingParams(dimensions=16).verify("embed", **listed).dimensions == 16
    with pytest.raises(ValueError, match=r"only supports \[16, 32\] matryoshka dimensions"):
        PoolingParams(dimensions=8).verify("embed", **listed)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens=0: expected an int >= 1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens=-2"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens=2.0"),
        ({"dimensions": 0}, "dimensions=0: expected an int >= 1"),
        ({"normalize": 1}, "normalize=1: expected a bool"),
        ({"use_activation": "yes"}, "use_activation='yes'"),
        ({"task": "generate"}, "task='generate'"),
        ({"token_type_start": 0}, "token_type_start=0"),
    ],
)
def test_bad_values_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**fields)
