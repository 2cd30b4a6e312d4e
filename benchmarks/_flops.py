"""The matrix-product arithmetic of a compiled program, and the rate this device runs
matrix products at: together, a floor on a step's time that no program computing the
same products can beat here (`product_flops`, and `matmul_program` timed). Self-contained
(JAX only), so the tests load it by path.

The products are counted in XLA's optimised program (`compiled.as_text()`), so what
XLA removed as dead or merged as common is not counted, and each loop body counts
once per iteration (XLA's ``known_trip_count``)."""

import functools
import math
import re
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

__all__ = ["matmul_program", "product_flops"]

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{$")
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_SHAPE = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_OP = re.compile(r"^([a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body)=%([\w.\-]+)")
_CALLED_SET = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TWO_WAY = re.compile(r"\btrue_computation=%([\w.\-]+), false_computation=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACT = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
_GEMM = re.compile(r'custom_call_target="[^"]*(?:gemm|matmul)[^"]*"', re.IGNORECASE)
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _split_type(rest: str) -> tuple[str, str]:
    """An instruction's result type and what follows it (a tuple type has spaces)."""
    if not rest.startswith("("):
        kind, _, after = rest.partition(" ")
        return kind, after
    depth = 0
    for n, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[: n + 1], rest[n + 1 :].lstrip()
    raise ValueError(f"product_flops: unbalanced tuple type in {rest[:80]!r}")


def _operands(text: str) -> Iterator[str]:
    depth, start = 0, 0
    for n, char in enumerate(text):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if depth < 0:
            yield text[start:n].strip()
            return
        if depth == 0 and char == ",":
            yield text[start:n].strip()
            start = n + 1


class _Computation:
    def __init__(self, params: str) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        for param in params.split(", "):
            name, _, kind = param.partition(": ")
            shape = _SHAPE.match(kind)
            if shape is not None:
                self.shapes[name.lstrip("%")] = _dims(shape.group(1))
        self.flops = 0.0
        self.calls: list[tuple[str, int]] = []  # (computation, times per run)
        self.branches: list[list[str]] = []  # a conditional's computations

    def add(self, line: str) -> None:
        name = _NAME.match(line)
        if name is None:
            return
        kind, after = _split_type(line[name.end() :])
        shape = _SHAPE.match(kind)
        if shape is not None:
            self.shapes[name.group(1)] = _dims(shape.group(1))
        op = _OP.match(after)
        if op is None:
            return
        if op.group(1) == "dot" and shape is not None:
            self.flops += self._dot(_dims(shape.group(1)), after[op.end() :])
        elif op.group(1) == "custom-call" and _GEMM.search(after):  # a library GEMM (GPU)
            self.flops += self._gemm(kind, after[op.end() :])
        trip = _TRIP.search(after)
        times = int(trip.group(1)) if trip and op.group(1) == "while" else 1
        for called in _CALLED.findall(after):
            self.calls.append((called, times))
        for group in _CALLED_SET.findall(after):
            names = [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            if op.group(1) == "conditional":
                self.branches.append(names)
            else:
                self.calls.extend((c, 1) for c in names)
        two_way = _TWO_WAY.search(after)
        if two_way is not None:
            self.branches.append(list(two_way.groups()))
        if op.group(1) == "while" and trip is None:
            raise ValueError(
                "product_flops: a while loop without a known trip count; count a "
                "program whose loops are scans of a fixed length"
            )

    def _lhs_shape(self, operands: str) -> tuple[int, ...]:
        lhs = next(_operands(operands))
        shape = _SHAPE.match(lhs)
        return _dims(shape.group(1)) if shape else self.shapes[lhs.split()[-1].lstrip("%")]

    def _dot(self, out: tuple[int, ...], operands: str) -> float:
        contract = _CONTRACT.search(operands)
        contracted = _dims(contract.group(1)) if contract else ()
        lhs = self._lhs_shape(operands)
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted)

    def _gemm(self, kind: str, operands: str) -> float:
        """A GEMM custom call (cuBLAS): its result is the first element of a tuple
        (result, workspace) or the whole type; its contraction is in its backend
        config's ``dot_dimension_numbers``."""
        out = _SHAPE.match(kind.lstrip("("))
        contract = _GEMM_CONTRACT.search(operands)
        if out is None or contract is None:
            raise ValueError(f"product_flops: a GEMM call not understood: {operands[:200]!r}")
        contracted = [int(d.strip().strip('"')) for d in contract.group(1).split(",") if d.strip()]
        lhs = self._lhs_shape(operands)
        return 2.0 * math.prod(_dims(out.group(1))) * math.prod(lhs[d] for d in contracted)


def product_flops(hlo_text: str) -> float:
    """Floating-point operations of the matrix products in an optimised HLO module's
    text (``dot`` instructions, inside fusions too, and GEMM library calls such as
    cuBLAS's), loop bodies counted once per iteration and a conditional by its
    costliest branch; a loop without a known trip count is a `ValueError`."""
    computations: dict[str, _Computation] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            current = computations[header.group(1)] = _Computation(header.group(2))
            if line.startswith("ENTRY"):
                entry = header.group(1)
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.add(line)
    if not entry:
        raise ValueError("product_flops: no ENTRY computation in the HLO text")
    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in memo:
            c = computations[name]
            memo[name] = (
                c.flops
                + sum(times * total(called) for called, times in c.calls)
                + sum(max(total(b) for b in branch) for branch in c.branches)
            )
        return memo[name]

    return total(entry)


def matmul_program(n: int | None = None) -> tuple[Callable[[], jax.Array], float]:
    """One float32 ``n × n`` by ``n × n`` product on the default device (``n`` 2,048
    on the CPU, 8,192 elsewhere), compiled, and its floating-point operations: timed
    beside other programs, the rate a large matrix product reaches here."""
    if n is None:
        n = 2048 if jax.default_backend() == "cpu" else 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    product = jax.jit(lambda x: x @ x).lower(a).compile()
    return functools.partial(product, a), 2.0 * n**3
