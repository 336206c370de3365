"""Persistent versions of a few dicts, stored as one shared set of dicts plus undo logs.

Why not `immutables.Map`: a block pool holds several maps of up to ~10^6 entries, and on Python
3.11 the cyclic GC repeatedly traverses every HAMT node (they are always GC-tracked), which made a
256k-block pool ~10x slower per operation than a 4k one. Plain dicts whose keys and values are ints
or bytes are untracked by the GC, and a dict operation costs ~50 ns at any size.

Representation (Baker's "shallow binding" of persistent arrays): the *current* version owns the
shared dicts; every other version holds the undo log that turns its neighbour towards the current
version into itself. Reading or writing a version that is not current first re-roots the store
onto it (cost ~ the changes between the two versions). So every version stays valid and unchanged
forever, the newest one is O(1) to read and update, and old ones are O(changes) to revisit.
Not safe for concurrent use from several threads (re-rooting mutates the shared dicts).

A table may also be dense (`IntSlots`, `ObjSlots`): one slot per key 0..n-1, a sentinel meaning
"absent". Per-block fields of a large pool then cost a 4- or 8-byte contiguous slot instead of a
dict entry plus a boxed int, which keeps a 256k-block pool's working set in cache. Their undo-log
entries hold the old slot value (never ABSENT).
"""

from array import array

ABSENT = object()  # an undo-log value meaning "the key was not in the dict"


class IntSlots(array):
    """Dense int table, 0 meaning absent. `t[k]` reads and writes the raw slot (hot loops).

    The mapping methods (`get`, `in`, `len`, iteration, `items`) see only non-zero slots; `len`
    and iteration are O(n), for tests and invariant checks.
    """

    __slots__ = ()

    def __new__(cls, size: int) -> "IntSlots":
        return super().__new__(cls, "i", bytes(4 * size))

    def get(self, key: int, default: object = None) -> object:
        return self[key] or default

    def __contains__(self, key: object) -> bool:
        return self[key] != 0

    def __len__(self) -> int:
        return array.__len__(self) - self.count(0)

    def __iter__(self):
        return (key for key, value in enumerate(array.__iter__(self)) if value)

    def items(self):
        return ((key, value) for key, value in enumerate(array.__iter__(self)) if value)


class ObjSlots(list):
    """Dense object table, None meaning absent; same read protocol as `IntSlots`."""

    __slots__ = ()

    def __init__(self, size: int) -> None:
        super().__init__([None] * size)

    def get(self, key: int, default: object = None) -> object:
        value = self[key]
        return default if value is None else value

    def __contains__(self, key: object) -> bool:
        return self[key] is not None

    def __len__(self) -> int:
        return list.__len__(self) - self.count(None)

    def __iter__(self):
        return (key for key, value in enumerate(list.__iter__(self)) if value is not None)

    def items(self):
        return ((key, value) for key, value in enumerate(list.__iter__(self)) if value is not None)


class _Store:
    __slots__ = ("tables", "current")

    def __init__(self, tables: tuple) -> None:
        self.tables: tuple = tables
        self.current: Version | None = None


class Version:
    """One immutable version of the store's dicts; only this module reads its fields."""

    __slots__ = ("_store", "_toward_current", "_undo")

    def __init__(self, store: _Store) -> None:
        self._store = store
        self._toward_current: Version | None = None
        # Flat (table, key, old value) triples in write order; None on the current version.
        self._undo: tuple | None = None


def new_version(num_tables: int) -> Version:
    return new_version_of(tuple({} for _ in range(num_tables)))


def new_version_of(tables: tuple) -> Version:
    """A first version owning `tables` (empty dicts, `IntSlots`, `ObjSlots`); the caller drops them."""
    store = _Store(tables)
    version = Version(store)
    store.current = version
    return version


def read(version: Version) -> tuple[dict, ...]:
    """The dicts as of `version`. Read-only, and only until the next call into this module."""
    store = version._store
    if store.current is not version:
        _reroot(version)
    return store.tables


class Transaction:
    """Writes applied in place with an undo log; `commit` makes a new version, `abort` reverts.

    Hot loops may write a table directly if they first append `(table, key, old value or ABSENT)`
    to `log`, exactly as `set` and `delete` do (a dense table logs its old slot value).
    """

    __slots__ = ("tables", "log", "_base")

    def __init__(self, base: Version) -> None:
        self.tables = read(base)
        self.log: list = []
        self._base = base

    def set(self, table: int, key: object, value: object) -> None:
        target = self.tables[table]
        old = target.get(key, ABSENT) if type(target) is dict else target[key]
        self.log += (table, key, old)
        target[key] = value

    def delete(self, table: int, key: object) -> None:
        """Remove a dict entry (a dense table has no delete: write its sentinel with `set`)."""
        target = self.tables[table]
        if type(target) is not dict:
            raise TypeError(f"delete: table {table} is dense; set its slot {key!r} to the sentinel")
        self.log += (table, key, target.pop(key))

    def commit(self) -> Version:
        base = self._base
        if not self.log:
            return base
        version = Version(base._store)
        base._toward_current = version
        base._undo = tuple(self.log)
        base._store.current = version
        self.log = []
        return version

    def abort(self) -> None:
        _apply_undo(self.tables, self.log)
        self.log = []


def _apply_undo(tables: tuple[dict, ...], undo) -> list:
    """Revert `undo` (newest write first) and return the log that re-applies it."""
    redo: list = []
    for position in range(len(undo) - 3, -1, -3):
        table, key, old = undo[position], undo[position + 1], undo[position + 2]
        target = tables[table]
        if type(target) is not dict:
            redo += (table, key, target[key])
            target[key] = old
            continue
        redo += (table, key, target.get(key, ABSENT))
        if old is ABSENT:
            del target[key]
        else:
            target[key] = old
    return redo


def _reroot(version: Version) -> None:
    path = [version]
    while path[-1]._toward_current is not None:
        path.append(path[-1]._toward_current)
    store = version._store
    for position in range(len(path) - 2, -1, -1):
        node, current = path[position], path[position + 1]
        # Undoing `node`'s log in reverse yields a log that, undone in reverse, redoes it.
        current._undo = tuple(_apply_undo(store.tables, node._undo))
        current._toward_current = node
        node._undo = None
        node._toward_current = None
        store.current = node
