"""Read-only containers for what is built once and then only read: a decision's load, a route, a
request's record.

`FrozenDict` and `FrozenList` are a `dict` and a `list` that refuse every change, so that JSON
encoders, `isinstance`, `copy.deepcopy` and `pickle` treat them as what they were built from (a
`MappingProxyType` is none of these). Not tuples: orjson (3.13) encodes tuples without its depth
limit, and a tuple nested a few thousand deep (an upstream's answer is kept as parsed) corrupts its
heap. `freeze` turns a value's nested dicts, lists, tuples and sets into their read-only kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


def _refuse(self: object, *args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(f"{type(self).__name__} is read-only")


class FrozenDict(dict[Any, Any]):
    """A dict that raises TypeError on any change."""

    __slots__ = ()

    __setitem__ = _refuse
    __delitem__ = _refuse
    __ior__ = _refuse
    clear = _refuse
    pop = _refuse
    popitem = _refuse
    setdefault = _refuse
    update = _refuse

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[Any, Any]]]:
        # The default reduction refills the new object item by item, which this class refuses.
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


class FrozenList(list[Any]):
    """A list that raises TypeError on any change."""

    __slots__ = ()

    __setitem__ = _refuse
    __delitem__ = _refuse
    __iadd__ = _refuse
    __imul__ = _refuse
    append = _refuse
    extend = _refuse
    insert = _refuse
    pop = _refuse
    remove = _refuse
    clear = _refuse
    sort = _refuse
    reverse = _refuse

    def __reduce__(self) -> tuple[type[FrozenList], tuple[list[Any]]]:
        return (FrozenList, (list(self),))

    def __copy__(self) -> FrozenList:
        return self

    def __repr__(self) -> str:
        return f"FrozenList({list.__repr__(self)})"


def freeze(value: T) -> T:
    """`value` with every nested dict, list, tuple and set read-only (a FrozenDict, a FrozenList, a
    frozenset);
    other values as they are (frozen dataclasses freeze their own fields).

    Iterative, not recursive: a value parsed from a backend's answer may nest deeper than Python's
    recursion limit, and must still be kept (the writer fits what no encoder can write)."""
    if not _container(value):
        return value
    done: list[Any] = []  # finished values, in the order their parents will take them
    # (value, children pushed) pairs: a container is rebuilt once its children are done.
    todo: list[tuple[Any, bool]] = [(value, False)]
    while todo:
        item, expanded = todo.pop()
        if not _container(item):
            done.append(item)
        elif not expanded:
            todo.append((item, True))
            children = list(item.values()) if isinstance(item, Mapping) else list(item)
            todo.extend((child, False) for child in reversed(children))
        else:
            n = len(item)
            children = done[len(done) - n :] if n else []
            del done[len(done) - n :]
            done.append(_rebuilt(item, children))
    return done[0]  # type: ignore[no-any-return]


def _container(value: Any) -> bool:
    frozen = (FrozenDict, FrozenList, frozenset)
    return isinstance(value, (Mapping, list, tuple, set)) and not isinstance(value, frozen)


def _rebuilt(item: Any, children: list[Any]) -> Any:
    if isinstance(item, Mapping):
        return FrozenDict(zip(item.keys(), children, strict=True))
    if isinstance(item, set):
        return frozenset(children)
    return FrozenList(children)
