"""The `HiddenPerturbation` artifact: the step with zero perturbations added."""

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._typing import Path, Shape
from ._group import HiddenGroup
from ._jaxpr import Program

__all__ = ["HiddenPerturbation", "Region", "zero_perturbation"]


class Region(NamedTuple):
    """Where an instant equation's output cotangent can be formed from stacked steps.

    The equations downstream of the instant equation's outputs, up to and including
    the first product with other weights on every route (the *frontier*: an ETP op, a
    ``dot_general`` or a convolution whose other operands are all weight values); none
    of the values before the frontier is a model output. The step then
    keeps the cotangents of the frontier products' outputs (their ``ε``) and the
    per-step values the region reads; the chunked drivers pull those cotangents back
    through the region for all the chunk's steps at once, so the products with the
    frontier weights' transposes run once per chunk instead of once per step.

    - `eqns`: the region's equations after the instant one, in order (frontier
      products included).
    - `frontier`: ``(equation, output, ε slot)`` of each frontier output.
    - `values`: indices into `HiddenPerturbation.value_slots` of the per-step values
      the region reads: the instant equation's outputs first (in order, dropped ones
      left out), then the other values.
    - `slices`: the values the region reads that are a piece of one of the instant
      equation's operands (the ``h`` of ``[x; h]``), which the steps keep anyway:
      ``(equation, operand, operand slot, axis, start, size)``: where the region reads
      it, the index into `HiddenPerturbation.operand_slots`, and the piece.
    """

    eqns: tuple[int, ...]
    frontier: tuple[tuple[int, int, int], ...]
    values: tuple[int, ...]
    slices: tuple[tuple[int, int, int, int, int, int], ...] = ()


def zero_perturbation(like: Any) -> Any:
    """A zero perturbation shaped, typed and sharded like `like` (an array, or a value
    with units; varying under ``shard_map`` as it does): a negative zero, since
    ``x + (−0.0)`` is ``x`` bit for bit (``−0.0 + 0.0`` is ``+0.0``), so a perturbed
    step's outputs equal the step's."""
    return jnp.full_like(like, -0.0)


class HiddenPerturbation(eqx.Module):
    """The perturbed step: inputs ``[flat args, flat states, p..., q..., δ...]``.

    **Arguments:**

    - `perturb_hidden_paths`: the hidden states perturbed, in compiled order (one
      perturbation ``p`` of the new value and one ``q`` of the old value each,
      shaped like the state).
    - `shapes`, `dtypes`: of each perturbation.
    - `program`: the perturbed step; its outputs are those of the rewritten step.
    - `direct_paths`: hidden states whose old value reaches the outputs other than
      through a new hidden value (``q`` matters only for these).
    - `use_indices`: the parameter uses (`ETraceGraph.param_uses`) that get a
      perturbation ``δ`` of the weight value they read; `use_shapes`, `use_dtypes`
      their avals.
    - `num_outputs`: how many of the program's outputs are the step's; the rest are
      the operands named by `operand_slots`.
    - `instant_eqns`: the equations reading those weights; `eps_slots` gives, per
      instant equation and output, the index of its output perturbation ``ε`` (or
      `None` for a dropped output); `eps_shapes`, `eps_dtypes` their avals.
    - `operand_slots`: ``(equation, operand)`` of every non-weight variable operand of
      the instant equations, in the order the program returns them.
    - `regions`: per instant equation, its `Region` (or `None`: its output cotangent
      is kept per step).
    - `value_slots`: the per-step values the regions read, returned after the
      operands: ``(equation, operand)``, or ``(equation, -1 - output)`` for an
      equation's output.
    """

    perturb_hidden_paths: tuple[Path, ...] = eqx.field(static=True)
    shapes: tuple[Shape, ...] = eqx.field(static=True)
    dtypes: tuple[np.dtype[Any], ...] = eqx.field(static=True)
    program: Program = eqx.field(static=True)
    direct_paths: tuple[Path, ...] = eqx.field(static=True, default=())
    use_indices: tuple[int, ...] = eqx.field(static=True, default=())
    use_shapes: tuple[Shape, ...] = eqx.field(static=True, default=())
    use_dtypes: tuple[np.dtype[Any], ...] = eqx.field(static=True, default=())
    num_outputs: int = eqx.field(static=True, default=0)
    instant_eqns: tuple[int, ...] = eqx.field(static=True, default=())
    eps_slots: tuple[tuple[int | None, ...], ...] = eqx.field(static=True, default=())
    eps_shapes: tuple[Shape, ...] = eqx.field(static=True, default=())
    eps_dtypes: tuple[np.dtype[Any], ...] = eqx.field(static=True, default=())
    operand_slots: tuple[tuple[int, int], ...] = eqx.field(static=True, default=())
    regions: tuple[Region | None, ...] = eqx.field(static=True, default=())
    value_slots: tuple[tuple[int, int], ...] = eqx.field(static=True, default=())

    @property
    def perturb_jaxpr(self) -> Any:
        return self.program.closed

    def init_perturb_data(self) -> list[Array]:
        """Zero perturbations (negative zeros, as `zero_perturbation`)."""
        return [jnp.full(s, -0.0, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def init_use_data(self) -> list[Array]:
        """Zero use perturbations ``δ``."""
        return [jnp.zeros(s, d) for s, d in zip(self.use_shapes, self.use_dtypes, strict=True)]

    def init_eps_data(self) -> list[Array]:
        """Zero output perturbations ``ε`` of the instant equations and of the regions'
        frontier products."""
        return [jnp.zeros(s, d) for s, d in zip(self.eps_shapes, self.eps_dtypes, strict=True)]

    def eval_jaxpr(
        self,
        flat_inputs: Sequence[Any],
        perturb_data: Sequence[Any],
        old_perturb_data: Sequence[Any] | None = None,
        use_data: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Evaluate the perturbed step on flat inputs and perturbations (``q = 0`` and
        ``δ = 0`` unless `old_perturb_data` / `use_data` are given)."""
        outs, _ = self.eval_with_operands(flat_inputs, perturb_data, old_perturb_data, use_data)
        return outs

    def eval_with_operands(
        self,
        flat_inputs: Sequence[Any],
        perturb_data: Sequence[Any],
        old_perturb_data: Sequence[Any] | None = None,
        use_data: Sequence[Any] | None = None,
        eps_data: Sequence[Any] | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """As `eval_jaxpr`, with output perturbations ``ε`` (zero unless given); also
        returns the instant equations' operands (`operand_slots`), then the regions'
        per-step values (`value_slots`)."""
        if len(perturb_data) != len(self.shapes):
            raise ValueError(
                f"expected {len(self.shapes)} perturbations (one per hidden state "
                f"{list(self.perturb_hidden_paths)}), got {len(perturb_data)}"
            )
        if old_perturb_data is None:
            old_perturb_data = [zero_perturbation(p) for p in perturb_data]
        if use_data is None:
            use_data = self.init_use_data()
        if eps_data is None:
            eps_data = self.init_eps_data()
        outs = self.program(*flat_inputs, *perturb_data, *old_perturb_data, *use_data, *eps_data)
        return outs[: self.num_outputs], outs[self.num_outputs :]

    def perturb_data_to_hidden_group_data(
        self, data: Sequence[Array] | Mapping[Path, Array], groups: Sequence[HiddenGroup]
    ) -> list[Array]:
        """Arrange per-state perturbation gradients into one slab per group."""
        if isinstance(data, Mapping):
            by_path = dict(data)
        else:
            if len(data) != len(self.perturb_hidden_paths):
                raise ValueError(
                    f"expected {len(self.perturb_hidden_paths)} values, got {len(data)}"
                )
            by_path = dict(zip(self.perturb_hidden_paths, data, strict=True))
        out = []
        for g in groups:
            missing = [p for p in g.hidden_paths if p not in by_path]
            if missing:
                raise ValueError(f"no perturbation gradient for hidden state(s) {missing}")
            out.append(g.concat_hidden([by_path[p] for p in g.hidden_paths]))
        return out
