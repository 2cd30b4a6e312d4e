"""An immutable, hashable mapping (for static metadata)."""

from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar, final

import jax
import numpy as np

from ._compat import array_key

__all__ = ["FrozenDict", "hashable"]

K = TypeVar("K")
V = TypeVar("V")


def hashable(value: Any) -> Any:
    """A hashable stand-in for `value` (itself when it already is hashable)."""
    try:
        hash(value)
    except TypeError:
        if isinstance(value, Mapping):
            return tuple((k, hashable(v)) for k, v in value.items())
        if isinstance(value, list | tuple):
            return tuple(hashable(v) for v in value)
        if isinstance(value, np.ndarray | jax.Array):
            return array_key(value)
        return repr(value)
    return value


@final
class FrozenDict(Mapping[K, V], Generic[K, V]):
    """An insertion-ordered mapping that cannot change and hashes by content."""

    __slots__ = ("_data", "_hash")

    _data: dict[K, V]
    _hash: int | None

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        object.__setattr__(self, "_data", dict(items or {}))
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("FrozenDict is immutable")

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def _key(self) -> tuple[Any, ...]:
        return tuple((k, hashable(v)) for k, v in self._data.items())

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash(self._key())
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, FrozenDict):
            return NotImplemented
        return self._key() == other._key()

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"
