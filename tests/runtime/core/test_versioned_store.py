"""Every version of a versioned store keeps its content, whichever order versions are revisited."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.core.kv import versioned_store as vs


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


SLOTS = 6
DICT_TABLE, INT_TABLE, OBJ_TABLE = 0, 1, 2
INT_VALUES = st.sampled_from([0, 1, 2, 7, -1, -(2**31), 2**31 - 1])
# 0, False and "" are present values in an ObjSlots table: only None means absent.
OBJ_VALUES = st.sampled_from([None, 0, False, "", "a", b"h", (1, 2), -3])
KEYS = st.integers(0, SLOTS - 1)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.just(INT_TABLE), KEYS, INT_VALUES),
        st.tuples(st.just("set"), st.just(OBJ_TABLE), KEYS, OBJ_VALUES),
        st.tuples(st.just("set"), st.just(DICT_TABLE), st.integers(0, 3), st.integers(-2, 2)),
        st.tuples(st.just("delete"), st.sampled_from([0, 1, 2]), KEYS, st.none()),
    ),
    max_size=8,
)
STEPS = st.lists(
    st.tuples(
        st.integers(0, 10**6),  # base version, modulo the number of versions so far
        OPS,
        st.booleans(),  # abort instead of commit
        st.lists(st.integers(0, 10**6), max_size=4),  # old versions to re-read, in this order
    ),
    min_size=1,
    max_size=25,
)


def raw_snapshot(version: vs.Version) -> tuple[dict, list, list]:
    """Plain-Python copy of every slot, absent ones included (raw indexing, not the map view)."""
    dict_table, int_table, obj_table = vs.read(version)
    assert type(int_table) is vs.IntSlots and type(obj_table) is vs.ObjSlots
    return (
        dict(dict_table),
        [int_table[key] for key in range(SLOTS)],
        [obj_table[key] for key in range(SLOTS)],
    )


def assert_matches(version: vs.Version, snapshot: tuple[dict, list, list]) -> None:
    raw = raw_snapshot(version)
    # repr also tells False from 0, which == would not.
    assert raw[:2] == snapshot[:2] and list(map(repr, raw[2])) == list(map(repr, snapshot[2]))
    dict_table, int_table, obj_table = vs.read(version)
    present_ints = {key: value for key, value in enumerate(snapshot[1]) if value != 0}
    present_objs = {key: value for key, value in enumerate(snapshot[2]) if value is not None}
    assert len(dict_table) == len(snapshot[0])
    assert dict(dict_table.items()) == snapshot[0]
    for table, present in ((int_table, present_ints), (obj_table, present_objs)):
        assert len(table) == len(present)
        assert list(table) == sorted(present)
        assert list(table.items()) == sorted(present.items())
    missing = object()
    for table, present in (
        (dict_table, snapshot[0]),
        (int_table, present_ints),
        (obj_table, present_objs),
    ):
        for key in range(SLOTS):
            assert (key in table) == (key in present)
            assert table.get(key) == present.get(key)
            if key in present:
                assert table.get(key, missing) == present[key]
            else:
                assert table.get(key, missing) is missing


@settings(max_examples=200)
@given(steps=STEPS)
def test_dense_and_dict_tables_keep_every_old_version(steps):
    first = vs.new_version_of(({}, vs.IntSlots(SLOTS), vs.ObjSlots(SLOTS)))
    versions = [first]
    snapshots = [raw_snapshot(first)]
    for base_pick, ops, abort, probes in steps:
        base = base_pick % len(versions)
        expected = (dict(snapshots[base][0]), list(snapshots[base][1]), list(snapshots[base][2]))
        tx = vs.Transaction(versions[base])
        for kind, table, key, value in ops:
            if kind == "set":
                tx.set(table, key, value)
                if table == DICT_TABLE:
                    expected[0][key] = value
                else:
                    expected[table][key] = value
            elif table != DICT_TABLE:
                logged = list(tx.log)
                with pytest.raises(TypeError, match="dense"):
                    tx.delete(table, key)
                assert tx.log == logged
            elif key in expected[0]:
                tx.delete(table, key)
                del expected[0][key]
            else:
                with pytest.raises(KeyError):
                    tx.delete(table, key)
        if abort:
            tx.abort()
            assert_matches(versions[base], snapshots[base])
        else:
            versions.append(tx.commit())
            snapshots.append(expected)
            assert_matches(versions[-1], expected)
        for probe in probes:
            index = probe % len(versions)
            assert_matches(versions[index], snapshots[index])
    for index in reversed(range(len(versions))):
        assert_matches(versions[index], snapshots[index])
