"""Every version of a versioned store keeps its content, whichever order versions are revisited."""

import random

import pytest

from runtime.core import versioned_store as vs


def contents(version: vs.Version) -> list[dict]:
    return [dict(table) for table in vs.read(version)]


def test_random_version_tree_keeps_every_version_intact():
    rng = random.Random(7)
    versions = [vs.new_version(2)]
    expected = [[{}, {}]]
    for _ in range(300):
        base = rng.randrange(len(versions))
        content = [dict(t) for t in expected[base]]
        tx = vs.Transaction(versions[base])
        for _ in range(rng.randrange(0, 6)):
            table, key = rng.randrange(2), rng.randrange(8)
            if key in content[table] and rng.random() < 0.4:
                tx.delete(table, key)
                del content[table][key]
            else:
                value = rng.randrange(100)
                tx.set(table, key, value)
                content[table][key] = value
        versions.append(tx.commit())
        expected.append(content)
        probe = rng.randrange(len(versions))
        assert contents(versions[probe]) == expected[probe]
    for version, content in zip(versions, expected, strict=True):
        assert contents(version) == content


def test_abort_restores_the_base_and_commit_without_writes_returns_it():
    base = vs.new_version(1)
    tx = vs.Transaction(base)
    tx.set(0, "a", 1)
    first = tx.commit()
    tx = vs.Transaction(first)
    tx.set(0, "a", 2)
    tx.set(0, "b", 3)
    tx.delete(0, "b")
    tx.abort()
    assert contents(first) == [{"a": 1}]
    assert vs.Transaction(first).commit() is first
    assert contents(base) == [{}]


def test_deleting_a_missing_key_raises_without_logging_it():
    tx = vs.Transaction(vs.new_version(1))
    with pytest.raises(KeyError):
        tx.delete(0, "missing")
    tx.abort()
