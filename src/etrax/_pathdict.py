"""`PathDict`: a dict keyed by state paths that is a pytree in insertion order.

Plain dicts are pytrees whose keys JAX sorts, which fails for paths mixing
strings and integers (``('layers', 0, 'w')`` vs ``('layers', 'norm')``). A
`PathDict` keeps the graph's state order instead.
"""

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from ._typing import Path

__all__ = ["PathDict"]

V = TypeVar("V")


class PathDict(dict[Path, V]):
    """A ``dict[path, value]`` flattened by JAX in insertion order.

    Two `PathDict`s with the same keys in the same order have the same tree
    structure, so they combine with `jax.tree.map`, optax updates and the like.
    """

    def __init__(self, items: Mapping[Path, V] | Iterable[tuple[Path, V]] = ()) -> None:
        super().__init__(items)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {_short(v)}" for k, v in self.items())
        return f"PathDict({{{inner}}})"


def _short(value: Any) -> str:
    """An array as its dtype and shape (``float32[3, 4]``); a concrete 0-d array as its
    value too (``float32(0.0123)``: a printed error or loss shows its number)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        if tuple(shape) == () and not isinstance(value, jax.core.Tracer):
            try:
                item = np.asarray(value).item()
            except (TypeError, ValueError):  # a typed PRNG key, a deleted buffer
                return f"{dtype}[]"
            return f"{dtype}({item:.6g})" if isinstance(item, float) else f"{dtype}({item!r})"
        return f"{dtype}{list(shape)}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_short(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _flatten(d: PathDict[Any]) -> tuple[list[tuple[Any, Any]], tuple[Path, ...]]:
    keys = tuple(d.keys())
    return [(jax.tree_util.DictKey(k), d[k]) for k in keys], keys


def _flatten_fast(d: PathDict[Any]) -> tuple[tuple[Any, ...], tuple[Path, ...]]:
    """As `_flatten` without the key objects: what every jitted call does to its
    arguments (without it JAX would build and drop a `DictKey` per entry)."""
    return tuple(d.values()), tuple(d.keys())


def _unflatten(keys: tuple[Path, ...], values: Iterable[Any]) -> PathDict[Any]:
    return PathDict(zip(keys, values, strict=True))


jax.tree_util.register_pytree_with_keys(PathDict, _flatten, _unflatten, _flatten_fast)
