"""An immutable mapping for frozen pydantic models: no dict anywhere inside a plan or spec.

:class:`FrozenMap` holds its items as a tuple of ``(key, value)`` pairs (insertion order kept),
reads like a ``Mapping``, is hashable, refuses every mutation, and validates from / serializes
to a plain dict, so JSON and digests are the same as with ``dict`` fields.

>>> from pydantic import BaseModel, ConfigDict
>>> class M(BaseModel):
...     model_config = ConfigDict(frozen=True)
...     sizes: FrozenMap[str, int]
>>> m = M(sizes={"head": 8})
>>> m.sizes["head"], m.model_dump_json()
(8, '{"sizes":{"head":8}}')
>>> m.sizes["head"] = 9
Traceback (most recent call last):
TypeError: 'FrozenMap' object does not support item assignment
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable, Generic, Hashable, TypeVar, get_args

from pydantic_core import core_schema

K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping, Generic[K, V]):
    """A read-only mapping backed by a tuple of pairs."""

    __slots__ = ("_pairs",)

    def __init__(self, items: Mapping | tuple = ()) -> None:
        pairs = tuple(items.items()) if isinstance(items, Mapping) else tuple((k, v) for k, v in items)
        object.__setattr__(self, "_pairs", tuple(dict(pairs).items()))

    def __getitem__(self, key):
        for k, v in self._pairs:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator:
        return (k for k, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def __hash__(self) -> int:
        return hash(self._pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._pairs) == dict(other.items())
        return NotImplemented

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("'FrozenMap' object is immutable")

    def __delattr__(self, name: str) -> None:
        raise TypeError("'FrozenMap' object is immutable")

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self._pairs)!r})"

    def __reduce__(self):
        return (FrozenMap, (self._pairs,))

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler) -> core_schema.CoreSchema:
        args = get_args(source) or (Any, Any)
        as_dict = handler.generate_schema(dict[args[0], args[1]])  # type: ignore[index]
        return core_schema.no_info_after_validator_function(
            cls, as_dict,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda m: dict(m._pairs), return_schema=as_dict))


class Memo:
    """An explicit cache of values derived from a frozen object: made on first use, then reused.

    Not part of the owner's value (never compared, printed or serialized).

    >>> m = Memo()
    >>> m.get("x", lambda: 41 + 1), m.get("x", lambda: 0)
    (42, 42)
    """

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict = {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        try:
            return self._values[key]
        except KeyError:
            return self._values.setdefault(key, make())

    def __repr__(self) -> str:
        return f"Memo({len(self._values)} values)"
