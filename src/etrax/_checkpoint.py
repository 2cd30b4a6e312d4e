"""Saving and resuming online learning: a `Checkpoint` of everything a run carries.

A run's state is four pytrees: the model's parameters, its hidden (and other)
states, the learning rule's traces and the optimiser's state. They are written with
equinox's leaf serialisation (`eqx.tree_serialise_leaves`): every array is stored
exactly (a resumed run continues bit for bit), and no dependency beyond equinox is
needed. Reading needs a *template* with the same structure, which the code that
resumes already has: the graph is rebuilt from the model (compiling is
deterministic), not pickled — it holds traced programs and references to the
model's brainstate states.
"""

import pathlib
from typing import Any, BinaryIO, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._compat import is_prng_key
from ._errors import StepInputError
from .executor import ModelState

__all__ = ["Checkpoint", "load_checkpoint", "save_checkpoint"]

TraceT = TypeVar("TraceT")
OptT = TypeVar("OptT")


class Checkpoint(eqx.Module, Generic[TraceT, OptT]):
    """What a run carries from one call to the next.

    **Arguments:**

    - `state`: the model's `ModelState` (parameters, hidden and other states).
    - `traces`: the learning rule's traces (``rule.init(graph, state)`` to start).
    - `opt_state`: the optimiser's state (any pytree), or `None`.
    """

    state: ModelState
    traces: TraceT
    opt_state: OptT


def save_checkpoint(
    path_or_file: str | pathlib.Path | BinaryIO, checkpoint: Checkpoint[TraceT, OptT]
) -> None:
    """Write `checkpoint`'s arrays to a file (equinox leaf serialisation).

    !!! Example

        ```python
        etrax.save_checkpoint("run.eqx", etrax.Checkpoint(state, traces, opt_state))
        ```
    """
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            f"save_checkpoint needs an etrax.Checkpoint, got {type(checkpoint).__name__}"
        )
    eqx.tree_serialise_leaves(path_or_file, checkpoint, filter_spec=_as_saved)


def load_checkpoint(
    path_or_file: str | pathlib.Path | BinaryIO,
    like: Checkpoint[TraceT, OptT],
    *,
    partial: bool = False,
) -> Checkpoint[TraceT, OptT]:
    """Read a checkpoint written by `save_checkpoint` into the structure of `like`.

    `like` is a `Checkpoint` of the same model, rule and optimiser, e.g.
    ``Checkpoint(state_of(graph), rule.init(graph, state), opt.init(state.params))``
    for a graph rebuilt from the model. Shapes and dtypes must match, and the file
    must hold nothing more (a different model, batch size, rule or optimiser is a
    `StepInputError`); with ``partial=True`` arrays after the template's are ignored
    (e.g. the optimiser state, read with ``opt_state=None``).
    """
    if not isinstance(like, Checkpoint):
        raise TypeError(f"load_checkpoint needs a Checkpoint template, got {type(like).__name__}")
    try:
        if isinstance(path_or_file, str | pathlib.Path):
            with open(path_or_file, "rb") as f:
                loaded: Checkpoint[TraceT, OptT] = _read_checkpoint(f, like, partial)
        else:
            loaded = _read_checkpoint(path_or_file, like, partial)
    except StepInputError:
        raise
    except (RuntimeError, ValueError) as err:
        root: BaseException = err  # equinox wraps the leaf's own error: name both
        while (root.__cause__ or root.__context__) is not None:
            root = root.__cause__ or root.__context__  # type: ignore[assignment]
        detail = f"{err}" if root is err else f"{err}: {root}"
        raise StepInputError(
            f"the checkpoint does not fit the template: {detail.rstrip('.')}. Build the "
            "template from the same model (and batch size), rule and optimiser as the saved "
            "run."
        ) from err
    return loaded


_NPY_MAGIC = b"\x93NUMPY"
"""How every array `save_checkpoint` writes begins (NumPy's ``.npy`` format)."""


def _check_magic(f: BinaryIO) -> None:
    """Refuse a file that does not begin like a checkpoint (a file of something else:
    equinox would report a pickling error at the first leaf); a stream that cannot
    seek is left to the leaf reader."""
    if not f.seekable():
        return
    at = f.tell()
    head = f.read(len(_NPY_MAGIC))
    f.seek(at)
    if head and head != _NPY_MAGIC:  # an empty file is left to the leaf reader too
        raise StepInputError(
            "this is not a checkpoint written by etrax.save_checkpoint or learner.save: it "
            f"does not begin with a NumPy array (its first bytes are {head!r}). Check the "
            "path."
        )


def _read_checkpoint(
    f: BinaryIO, like: Checkpoint[TraceT, OptT], partial: bool
) -> Checkpoint[TraceT, OptT]:
    """Read `like`'s leaves from `f`; unless `partial`, refuse a file with arrays left
    over (saved from a larger template: another optimiser's state would otherwise be
    dropped)."""
    _check_magic(f)
    loaded: Checkpoint[TraceT, OptT] = eqx.tree_deserialise_leaves(
        f, like, filter_spec=_exactly_like
    )
    if not partial and f.seekable():
        at = f.tell()
        more = f.read(1)
        f.seek(at)
        if more:
            raise ValueError(
                "the file holds more arrays than the template (saved with another optimiser "
                "state, rule or model?)"
            )
    return loaded


def _as_saved(f: BinaryIO, x: Any) -> None:
    """Write one leaf; a typed PRNG key (a random state of the model, a stochastic
    rule's noise) as its raw key data, which NumPy can store."""
    if is_prng_key(x):
        np.save(f, np.asarray(jax.random.key_data(x)))
    else:
        eqx.default_serialise_filter_spec(f, x)


def _exactly_like(f: BinaryIO, x: Any) -> Any:
    """Read one leaf, refusing a saved array whose shape or dtype is not the
    template's (JAX would otherwise cast a float64 array to float32 silently); a
    typed PRNG key is wrapped back with the template's implementation."""
    if is_prng_key(x):
        data = jax.random.key_data(x)
        value = _read(f, data.shape, data.dtype, f"a PRNG key of shape {x.shape}")
        return jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and not jnp.issubdtype(x.dtype, jax.dtypes.extended):
        return jnp.asarray(_read(f, x.shape, x.dtype, f"shape {x.shape} and dtype {x.dtype}"))
    return eqx.default_deserialise_filter_spec(f, x)


def _read(f: BinaryIO, shape: tuple[int, ...], dtype: Any, template: str) -> np.ndarray:
    value: np.ndarray = np.load(f)
    if value.shape != shape or value.dtype != np.dtype(dtype):
        raise ValueError(
            f"a saved array of shape {value.shape} and dtype {value.dtype} where the "
            f"template has {template}"
        )
    return value
