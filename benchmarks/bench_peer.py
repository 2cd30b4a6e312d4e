"""etrax side by side with braintrace 0.2.6: the same models through both libraries
in one run (`python benchmarks/run.py peer [options]`, or `nox -s bench -- peer`).

For every configuration (model, layers, hidden size, batch) and both libraries:

- **forward**: the model's own brainstate ``update`` in a `jax.lax.scan` (through
  `brainstate.transform.StatefulFunction`; no Jacobians, no etrax), the baseline;
- **BPTT**: `jax.grad` over that scan;
- **D-RTRL**, **pp-prop** (decay 0.9) and **e-prop** (κ = 0.9, symmetric feedback):
  ``etrax.online_grad`` with ``etrax.DRTRL()``, ``etrax.PPProp(0.9)``,
  ``etrax.EProp(0.9)``; braintrace's ``D_RTRL``, ``pp_prop`` and ``EProp`` learners
  driven by their ``etrace_grad``.

Reported: per-step time (median over interleaved rounds of the compiled XLA
executable of one ``T``-step call, so no Python dispatch is timed), XLA's compiled
scratch memory (``memory_analysis().temp_size_in_bytes``), and the time to first
gradient (each library's user path from an initialised model: graph compile, tracing,
XLA compile and the first call), with the number of XLA compilations a second call
with new input values triggers; and, for pp-prop, the time of one call through each
library's user path, Python included (``learner.etrace_grad`` against braintrace's
jitted ``etrace_grad``). Ratios are to the same library's forward step and
etrax / braintrace. Each program's matrix-product arithmetic is counted in XLA's
optimised program and set beside the rate a large product reaches on this device
(``benchmarks/_flops.py``): the floor no program doing those products can beat here.
Results go to ``<out>/peer_<device>.md`` and ``.png``.

braintrace is imported only here; it is installed by ``nox -s bench`` and never in the
test or typecheck environments (``typings/braintrace`` stubs the surface used).
"""

import argparse
import dataclasses
import functools
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import brainstate
import braintrace
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

import etrax
from etrax.algorithms._drivers import _block_length as chunk_length  # the driver's own rule

from ._common import RESULTS, block, table
from ._flops import matmul_program, product_flops

Kind = Literal["GRU", "LSTM", "LIF", "ALIF"]
Lib = Literal["etrax", "braintrace"]
LIBS: tuple[Lib, ...] = ("etrax", "braintrace")
METHODS = ("forward", "BPTT", "D-RTRL", "pp-prop", "e-prop")
FIXED_WR = "pp-prop, W_r fixed"
"""etrax's pp-prop on GRU models whose reset-gate weights are constants: the work that
braintrace's pp-prop does (it leaves `Wr` at a zero gradient), timed beside both."""
N_IN = 10
DECAY = 0.9  # pp-prop's decay
KAPPA = 0.9  # e-prop's filter


@dataclasses.dataclass(frozen=True)
class Config:
    """One model size: ``layers`` stacked cells (or spiking layers) of ``hidden`` units
    and a ``Linear(hidden, 1)`` readout, driven with ``batch`` sequences (1: unbatched)."""

    model: Kind
    layers: int
    hidden: int
    batch: int

    @property
    def batch_size(self) -> int | None:
        return None if self.batch == 1 else self.batch

    @property
    def label(self) -> str:
        return f"{self.model}×{self.layers} H={self.hidden} B={self.batch}"


def _configs(
    models: Sequence[Kind], layers: Sequence[int], sizes: Sequence[tuple[int, int]]
) -> list[Config]:
    return [Config(m, n, h, b) for m, n, (h, b) in itertools.product(models, layers, sizes)]


MATRICES: dict[str, list[Config]] = {
    # this 2-core CPU, about 10 minutes: the acceptance sizes first
    "cpu": [
        Config("GRU", 1, 512, 32),
        Config("GRU", 1, 128, 1),
        Config("GRU", 1, 128, 32),
        Config("LSTM", 1, 128, 32),
        Config("LIF", 1, 128, 32),
        Config("ALIF", 1, 128, 32),
        Config("GRU", 2, 128, 32),
    ],
    # one GPU within about 8 minutes (XLA compiles dominate the small sizes)
    "gpu": [
        Config("GRU", 1, 512, 32),
        Config("GRU", 1, 128, 1),
        Config("GRU", 1, 2048, 32),
        Config("GRU", 1, 128, 32),
        Config("GRU", 1, 512, 1),
        Config("GRU", 1, 2048, 1),
        Config("LSTM", 1, 512, 32),
        Config("LIF", 1, 512, 32),
        Config("ALIF", 1, 512, 32),
        Config("GRU", 4, 512, 32),
        Config("GRU", 8, 128, 32),
    ],
    # everything the issue names (hours; meant for a GPU)
    "full": _configs(
        ("GRU", "LSTM", "LIF", "ALIF"),
        (1, 2, 4, 8),
        [(h, b) for h in (128, 512, 2048) for b in (1, 32)],
    ),
}


# --- the models ---------------------------------------------------------------------


class Stack(brainstate.nn.Module):
    """``layers`` recurrent cells, then a linear readout."""

    def __init__(self, cells: list[brainstate.nn.Module], readout: brainstate.nn.Module) -> None:
        super().__init__()
        self.cells = cells
        self.out = readout

    def update(self, x: ArrayLike) -> Array:
        h: Any = x
        for cell in self.cells:
            h = cell(h)
        out: Array = self.out(h)
        return out


class SpikingStack(brainstate.nn.Module):
    """Recurrent spiking layers ``s_l = neuron(W_in s_{l−1} + W_rec s_l^{t−1})``, then a
    linear readout of the last layer's spikes (the previous spikes are hidden states)."""

    def __init__(
        self,
        hidden: int,
        inputs: list[brainstate.nn.Module],
        recurrent: list[brainstate.nn.Module],
        neurons: list[brainstate.nn.Module],
        readout: brainstate.nn.Module,
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.inputs = inputs
        self.recurrent = recurrent
        self.neurons = neurons
        self.out = readout

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.hidden,) if batch_size is None else (batch_size, self.hidden)
        self.spikes = [brainstate.HiddenState(jnp.zeros(shape)) for _ in self.neurons]

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.init_state(batch_size)

    def update(self, x: ArrayLike) -> Array:
        s: Any = x
        for inp, rec, neuron, last in zip(
            self.inputs, self.recurrent, self.neurons, self.spikes, strict=True
        ):
            s = neuron(inp(s) + rec(last.value))
            last.value = s
        out: Array = self.out(s)
        return out


@jax.custom_jvp
def _spike(x: Array) -> Array:
    return (x >= 0).astype(x.dtype)


@_spike.defjvp
def _spike_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (x,), (dx,) = primals, tangents
    # the triangular surrogate of etrax.nn.ReluGrad() (α = 0.3, width 1)
    return _spike(x), 0.3 * jnp.maximum(0.0, 1.0 - jnp.abs(x)) * dx


class PlainLIF(brainstate.nn.Module):
    """etrax.nn.LIF's equations as a plain brainstate module (braintrace 0.2.6 has no
    neurons of its own): ``V ← αV + I − s^{t−1}``, ``s = H(V − 1)``, threshold 1, soft
    reset; with ``tau_a`` the ALIF adaptation ``a ← ρa + s^{t−1}``, ``s = H(V − 1 − βa)``."""

    def __init__(
        self, size: int, tau: float, tau_a: float | None = None, beta: float = 0.0
    ) -> None:
        super().__init__()
        self.size = size
        self.alpha = math.exp(-1.0 / tau)
        self.rho = None if tau_a is None else math.exp(-1.0 / tau_a)
        self.beta = beta

    def init_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        shape = (self.size,) if batch_size is None else (batch_size, self.size)
        self.V = brainstate.HiddenState(jnp.zeros(shape))
        if self.rho is not None:
            self.a = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        self.init_state(batch_size)

    def update(self, current: ArrayLike) -> Array:
        v = self.V.value
        if self.rho is None:
            last = _spike(v - 1.0)
            v = self.alpha * v + jnp.asarray(current) - last
            self.V.value = v
            return _spike(v - 1.0)
        a = self.a.value
        last = _spike(v - 1.0 - self.beta * a)
        v = self.alpha * v + jnp.asarray(current) - last
        a = self.rho * a + last
        self.V.value = v
        self.a.value = a
        return _spike(v - 1.0 - self.beta * a)


TAU, TAU_A, BETA = 10.0, 50.0, 0.5


def _linear(
    lib: Lib, n_in: int, n_out: int, *, scale: float | None = None, bias: bool = True
) -> brainstate.nn.Module:
    w_init = None if scale is None else brainstate.nn.init.KaimingNormal(scale=scale)
    if lib == "etrax":
        return etrax.nn.Linear(n_in, n_out, w_init=w_init, b_init="zeros" if bias else None)
    kwargs: dict[str, Any] = {} if w_init is None else {"w_init": w_init}
    return braintrace.nn.Linear(
        n_in, n_out, b_init=brainstate.nn.init.ZeroInit() if bias else None, **kwargs
    )


def _neuron(lib: Lib, kind: Kind, n: int) -> brainstate.nn.Module:
    if lib == "etrax":
        if kind == "ALIF":
            return etrax.nn.ALIF(n, tau=TAU, tau_a=TAU_A, beta=BETA)
        return etrax.nn.LIF(n, tau=TAU)
    if kind == "ALIF":
        return PlainLIF(n, TAU, TAU_A, BETA)
    return PlainLIF(n, TAU)


def make_model(lib: Lib, cfg: Config) -> brainstate.nn.Module:
    """`cfg`'s model built from `lib`'s layers (states not yet initialised)."""
    sizes = [N_IN] + [cfg.hidden] * cfg.layers
    readout = _linear(lib, cfg.hidden, 1)
    if cfg.model in ("GRU", "LSTM"):
        cells: list[brainstate.nn.Module] = []
        for n_in, n_out in itertools.pairwise(sizes):
            if lib == "etrax":
                cell = etrax.nn.GRUCell if cfg.model == "GRU" else etrax.nn.LSTMCell
                cells.append(cell(n_in, n_out))
            else:
                bt_cell = braintrace.nn.GRUCell if cfg.model == "GRU" else braintrace.nn.LSTMCell
                cells.append(bt_cell(n_in, n_out))
        return Stack(cells, readout)
    pairs = list(itertools.pairwise(sizes))
    return SpikingStack(
        cfg.hidden,
        [_linear(lib, n_in, n_out, scale=4.0) for n_in, n_out in pairs],
        [_linear(lib, n_out, n_out, scale=0.5, bias=False) for _, n_out in pairs],
        [_neuron(lib, cfg.model, n_out) for _, n_out in pairs],
        readout,
    )


def mse(y: Array, target: Array) -> Array:
    return jnp.mean((y - target) ** 2)


@dataclasses.dataclass(frozen=True)
class Data:
    x0: Array
    xs: Array
    xs2: Array  # new values for the second call
    targets: Array


def make_data(cfg: Config, T: int) -> Data:
    shape = (N_IN,) if cfg.batch == 1 else (cfg.batch, N_IN)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    xs = jax.random.normal(k1, (T, *shape), jnp.float32)
    xs2 = jax.random.normal(k2, (T, *shape), jnp.float32)
    targets = 0.1 * jax.random.normal(k3, (T, *shape[:-1], 1), jnp.float32)
    return Data(xs[0], xs, xs2, targets)


# --- the two libraries' online learners --------------------------------------------


def etrax_rule(method: str, chunk_steps: int | None = None) -> etrax.OnlineAlgorithm[Any]:
    """etrax's rule for `method` (`chunk_steps=None`: the library's default)."""
    if method == "D-RTRL":
        return etrax.DRTRL(chunk_steps=chunk_steps)
    if method == "pp-prop":
        return etrax.PPProp(DECAY, chunk_steps=chunk_steps)
    return etrax.EProp(KAPPA, chunk_steps=chunk_steps)


def _braintrace_learner(
    method: str, model: brainstate.nn.Module, cfg: Config, x0: Array
) -> braintrace.ETraceAlgorithm:
    """braintrace's one-call entry point (initialises the states and builds the graph)."""
    if method == "D-RTRL":
        return braintrace.compile(model, braintrace.D_RTRL, x0, batch_size=cfg.batch_size)
    if method == "pp-prop":
        return braintrace.compile(
            model, braintrace.pp_prop, x0, batch_size=cfg.batch_size, decay_or_rank=DECAY
        )
    return braintrace.compile(
        model, braintrace.EProp, x0, batch_size=cfg.batch_size, kappa_filter_decay=KAPPA
    )


def _braintrace_grad(learner: braintrace.ETraceAlgorithm) -> Callable[[Array, Array], Any]:
    """``(xs, targets) ↦ grads`` through braintrace's sequence driver (stateful)."""

    def step_loss(x: Array, target: Array) -> Array:
        return mse(learner(x), target)

    def grad(xs: Array, targets: Array) -> Any:
        return learner.etrace_grad(xs, targets, step_fn=step_loss)

    return grad


# --- compiled programs for the per-step time and the scratch memory -----------------


@dataclasses.dataclass
class Program:
    """An AOT-compiled XLA executable with its arguments bound, the floating-point
    operations of its matrix products per call (`product_flops`); for etrax's online
    rules also the bytes of the traces it carries and the steps per chunk it runs
    (for the memory-traffic floor, `traffic_floor_s`)."""

    run: Callable[[], Any]
    scratch_mib: float
    flops: float = math.nan
    trace_bytes: int = 0
    chunk: int = 0


def _aot(
    fn: Callable[..., Any], *args: Any, compiler_options: etrax.CompilerOptions | None = None
) -> Program:
    options = None if compiler_options is None else dict(compiler_options)
    compiled = jax.jit(fn, compiler_options=options).lower(*args).compile()
    mem = compiled.memory_analysis()
    scratch = math.nan if mem is None else mem.temp_size_in_bytes / 2**20
    return Program(functools.partial(compiled, *args), scratch, _flops_of(compiled.as_text()))


def _flops_of(hlo_text: str | None) -> float:
    """`product_flops` of a compiled program, or NaN (said on the console) where its
    text is missing or holds what the count does not understand, so that one such
    program leaves a gap in the table instead of stopping the run."""
    if hlo_text is None:
        return math.nan
    try:
        return product_flops(hlo_text)
    except (ValueError, KeyError, IndexError) as e:
        print(f"    matrix products not counted: {e}", flush=True)
        return math.nan


def stream_bandwidth(nbytes: int = 1 << 27, repeats: int = 9) -> float:
    """Bytes read plus bytes written per second by one element-wise pass over `nbytes`
    of float32 (the buffer donated, so nothing is allocated per pass): the memory
    bandwidth a trace update can reach on this device, measured in this process."""
    update = jax.jit(lambda a: a * 0.999, donate_argnums=0)
    x = block(update(jnp.ones((nbytes // 4,), jnp.float32)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x = block(update(x))
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def traffic_floor_s(trace_bytes: int, chunk: int, bandwidth: float) -> float:
    """Seconds per step that reading and writing every trace once per chunk of `chunk`
    steps takes at `bandwidth` (bytes read plus written per second): the floor of a
    per-parameter rule's step, whatever its arithmetic."""
    return 2 * trace_bytes / (max(chunk, 1) * bandwidth)


class PureStep:
    """A model's ``update`` as a pure function ``(state values, x) ↦ (state values, y)``
    (brainstate's `StatefulFunction`, independent of etrax and braintrace)."""

    def __init__(self, model: brainstate.nn.Module, x0: Array) -> None:
        self.fn = brainstate.transform.StatefulFunction(model.update)
        self.fn.make_jaxpr(x0)
        states = self.fn.get_states(x0)
        self.values: list[Any] = [s.value for s in states]
        self.is_param = [isinstance(s, brainstate.ParamState) for s in states]

    def __call__(self, values: list[Any], x: Array) -> tuple[list[Any], Array]:
        new, y = self.fn.jaxpr_call(values, x)
        # states the step only reads come back as None
        return [v if n is None else n for n, v in zip(new, values, strict=True)], y

    def forward(self, values: list[Any], xs: Array) -> tuple[list[Any], Array]:
        def body(v: list[Any], x: Array) -> tuple[list[Any], Array]:
            v, y = self(v, x)
            return v, jnp.sum(y)

        values, ys = jax.lax.scan(body, values, xs)
        return values, jnp.sum(ys)

    def bptt(self, values: list[Any], xs: Array, targets: Array) -> list[Any]:
        params = [v if p else None for v, p in zip(values, self.is_param, strict=True)]

        def loss(params: list[Any]) -> Array:
            v0 = [
                p if is_p else v for p, v, is_p in zip(params, values, self.is_param, strict=True)
            ]

            def body(v: list[Any], xt: tuple[Array, Array]) -> tuple[list[Any], Array]:
                v, y = self(v, xt[0])
                return v, mse(y, xt[1])

            _, losses = jax.lax.scan(body, v0, (xs, targets))
            return jnp.sum(losses)

        grads: list[Any] = jax.grad(loss)(params)
        return grads


def _initialised(lib: Lib, cfg: Config) -> brainstate.nn.Module:
    model = make_model(lib, cfg)
    brainstate.nn.init_all_states(model, batch_size=cfg.batch_size)
    return model


class FixedLinear(brainstate.nn.Module):
    """``x W + b`` with constant `W` and `b` (no ParamState: nothing to learn)."""

    def __init__(self, weight: Array, bias: Array | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def update(self, x: ArrayLike) -> Array:
        y = jnp.asarray(x) @ self.weight
        return y if self.bias is None else y + self.bias


def fix_reset_gates(model: brainstate.nn.Module) -> brainstate.nn.Module:
    """`model` (a GRU `Stack`) with each cell's reset-gate layer replaced by a
    `FixedLinear` of its current values."""
    assert isinstance(model, Stack)
    for cell in model.cells:
        assert isinstance(cell, etrax.nn.GRUCell)
        value = cell.Wr.weight.value
        fixed = FixedLinear(jnp.asarray(value["weight"]), value.get("bias"))
        cell.Wr = fixed  # type: ignore[assignment]  # a constant layer for the Linear
    return model


def build_program(
    lib: Lib,
    method: str,
    cfg: Config,
    data: Data,
    chunk_steps: int | None = None,
    compiler_options: etrax.CompilerOptions | Literal["auto"] | None = "auto",
) -> Program:
    """The compiled program of one (library, method) on fresh weights (etrax's online
    rules with `chunk_steps` and XLA's `compiler_options`: ``"auto"``, as
    `etrax.compile`'s default, picks `etrax.algorithms.default_compiler_options`)."""
    if method in ("forward", "BPTT"):
        step = PureStep(_initialised(lib, cfg), data.x0)
        if method == "forward":
            return _aot(step.forward, step.values, data.xs)
        return _aot(step.bptt, step.values, data.xs, data.targets)
    if lib == "etrax":
        model = _initialised(lib, cfg)
        if method == FIXED_WR:
            model, method = fix_reset_gates(model), "pp-prop"
        graph = etrax.compile_etrace_graph(model, data.x0)
        algo = etrax_rule(method, chunk_steps)
        state = etrax.state_of(graph)

        def online(state: etrax.ModelState, traces: Any, xs: Array, targets: Array) -> Any:
            grads, aux = etrax.online_grad(graph, algo, state, traces, xs, targets, mse)
            # what changed: returning the unchanged weights would copy them at every call
            # (braintrace's program returns nothing for states its step only reads)
            return grads, aux["state"].hidden, aux["state"].other, aux["traces"]

        traces = algo.init(graph, state)
        options = (
            etrax.algorithms.default_compiler_options(graph, algo)
            if compiler_options == "auto"
            else compiler_options
        )
        program = _aot(online, state, traces, data.xs, data.targets, compiler_options=options)
        program.trace_bytes = sum(int(np.asarray(a).nbytes) for a in jax.tree.leaves(traces))
        T = int(data.xs.shape[0])
        program.chunk = min(T, chunk_length(T, algo.chunk_for(graph)))
        return program
    learner = _braintrace_learner(method, make_model(lib, cfg), cfg, data.x0)
    fn = brainstate.transform.StatefulFunction(_braintrace_grad(learner))
    fn.make_jaxpr(data.xs, data.targets)
    values = [s.value for s in fn.get_states(data.xs, data.targets)]

    def pure(values: list[Any], xs: Array, targets: Array) -> tuple[Any, Any]:
        return fn.jaxpr_call(values, xs, targets)

    return _aot(pure, values, data.xs, data.targets)


# --- time to first gradient ----------------------------------------------------------


class CompileCounter:
    """Counts XLA compilations (JAX's backend-compile events) inside a ``with`` block."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0

    def _listener(self, event: str, duration_secs: float, **kwargs: object) -> None:
        if event == self.EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)


@dataclasses.dataclass(frozen=True)
class FirstCall:
    seconds: float  # graph compile + tracing + XLA compile + first call
    cpu_seconds: float  # the same, in this process's CPU time (robust to other load)
    recompiles: int  # XLA compilations in a second call with new input values
    second_seconds: float  # that second call (with any recompilation it triggers)
    zero_paths: tuple[str, ...]  # parameter leaves whose gradient is identically zero
    leaves: int

    @property
    def zero_leaves(self) -> int:
        return len(self.zero_paths)


def _zero_leaves(grads: Any) -> tuple[tuple[str, ...], int]:
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    zero = tuple(_path_name(path) for path, g in leaves if not np.any(np.asarray(g)))
    return zero, len(leaves)


def _path_name(path: Sequence[Any]) -> str:
    parts: list[str] = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
        parts.extend(str(k) for k in (key if isinstance(key, tuple) else (key,)))
    return ".".join(parts)


def online_call(
    lib: Lib,
    method: str,
    cfg: Config,
    model: brainstate.nn.Module,
    data: Data,
    compiler_options: etrax.CompilerOptions | Literal["auto"] | None = "auto",
) -> Callable[[Array], Any]:
    """``xs ↦ gradients`` of an online `method` through `lib`'s user path, built from
    `model` (etrax: `etrax.compile` and `learner.etrace_grad`, which also reads the
    model's states, writes the new hidden values back and checks for a silent network;
    braintrace: `braintrace.compile` and its jitted `etrace_grad`); etrax's learner
    with XLA's `compiler_options`."""
    if lib == "etrax":
        learner = etrax.compile(
            model,
            etrax_rule(method),
            data.x0,
            batch_size=cfg.batch_size,
            compiler_options=compiler_options,
        )

        def call(xs: Array) -> Any:
            return learner.etrace_grad(xs, data.targets, mse)

        return call
    jitted = brainstate.transform.jit(
        _braintrace_grad(_braintrace_learner(method, model, cfg, data.x0))
    )

    def bt_call(xs: Array) -> Any:
        return jitted(xs, data.targets)

    return bt_call


def first_call(
    lib: Lib,
    method: str,
    cfg: Config,
    data: Data,
    compiler_options: etrax.CompilerOptions | Literal["auto"] | None = "auto",
) -> FirstCall:
    """Each library's user path from a model with weights but no states yet, from
    cleared JAX caches: no build reuses a trace or an XLA program of an earlier one
    (an earlier build of the same model made a second one up to 30 % faster); etrax's
    online rules with XLA's `compiler_options`."""
    jax.clear_caches()  # type: ignore[no-untyped-call]  # unannotated in JAX
    model = make_model(lib, cfg)
    call: Callable[[Array], Any]
    start, cpu_start = time.perf_counter(), time.process_time()
    if method in ("forward", "BPTT"):
        brainstate.nn.init_all_states(model, batch_size=cfg.batch_size)
        step = PureStep(model, data.x0)
        if method == "forward":
            fwd = jax.jit(step.forward)
            call = functools.partial(fwd, step.values)
        else:
            bptt = jax.jit(step.bptt)

            def call(xs: Array) -> Any:
                return bptt(step.values, xs, data.targets)

    else:
        call = online_call(lib, method, cfg, model, data, compiler_options)
    out = block(call(data.xs))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    with CompileCounter() as counter:
        start = time.perf_counter()
        block(call(data.xs2))
        second = time.perf_counter() - start
    zero, leaves = _zero_leaves(out if method != "forward" else [])
    return FirstCall(seconds, cpu_seconds, counter.count, second, zero, leaves)


# --- one configuration, interleaved --------------------------------------------------


CALLED = "pp-prop"
"""The online method whose call through each library's user path is also timed."""


def user_call(lib: Lib, method: str, cfg: Config, data: Data) -> Program:
    """One `T`-step gradient call through `lib`'s user path on fresh weights, compiled
    (`online_call`): what a training loop pays per call, Python included."""
    call = online_call(lib, method, cfg, make_model(lib, cfg), data)
    block(call(data.xs))
    return Program(functools.partial(call, data.xs), math.nan)


@dataclasses.dataclass(frozen=True)
class Measured:
    step_s: float
    scratch_mib: float
    first: FirstCall
    trace_bytes: int = 0
    chunk: int = 0
    flops: float = math.nan  # of the matrix products, per step


@dataclasses.dataclass(frozen=True)
class FixedWr:
    """etrax's pp-prop on the model with constant reset gates (`FIXED_WR`)."""

    step_s: float
    flops: float  # of the matrix products, per step


@dataclasses.dataclass(frozen=True)
class ConfigRun:
    """One configuration's measurements (`measure`): every (library, method), etrax's
    pp-prop with fixed reset gates (GRU models only), each library's seconds per call
    through its user path, and the rate of a large matrix product timed among them."""

    measured: dict[tuple[Lib, str], Measured]
    fixed: FixedWr | None
    calls: dict[Lib, float]
    rate: float  # floating-point operations per second of `matmul_program`


MATMUL = "matmul"
"""The key of `matmul_program` among the interleaved programs."""


def _interleaved(
    programs: dict[tuple[Lib, str], Program], rounds: int, min_time: float
) -> dict[tuple[Lib, str], float]:
    """Median seconds per call of each program over `rounds` rounds that visit every
    program in turn (alternating direction), each sample at least `min_time` long.
    Programs slower than a second per call get at most three rounds."""
    samples = _interleaved_samples(programs, rounds, min_time)
    return {key: statistics.median(s) for key, s in samples.items()}


def _interleaved_samples(
    programs: dict[tuple[Lib, str], Program], rounds: int, min_time: float
) -> dict[tuple[Lib, str], list[float]]:
    """`_interleaved`'s samples: seconds per call of each program, one per round."""
    reps: dict[tuple[Lib, str], int] = {}
    samples: dict[tuple[Lib, str], list[float]] = {key: [] for key in programs}
    for key, program in programs.items():
        start = time.perf_counter()
        block(program.run())
        single = time.perf_counter() - start
        if single < 1.0:  # the first call may allocate: calibrate on a second one
            start = time.perf_counter()
            block(program.run())
            single = time.perf_counter() - start
        reps[key] = max(1, math.ceil(min_time / max(single, 1e-9)))
    order = list(programs)
    for r in range(rounds):
        for key in order if r % 2 == 0 else order[::-1]:
            if r >= 3 and samples[key] and min(samples[key]) > 1.0:
                continue
            run, n = programs[key].run, reps[key]
            start = time.perf_counter()
            for _ in range(n):
                block(run())
            samples[key].append((time.perf_counter() - start) / n)
    return samples


def measure(
    cfg: Config, index: int, T: int, rounds: int, min_time: float, first_repeats: int
) -> ConfigRun:
    """Every (library, method) of `cfg`; for GRU models, the per-step seconds of
    etrax's pp-prop with fixed reset gates (`FIXED_WR`); each library's seconds per
    `CALLED` call through its user path (`user_call`); and the rate of a large matrix
    product (`matmul_program`, its fastest sample), so that a drift of the machine's
    speed moves the floors with the steps; all interleaved."""
    data = make_data(cfg, T)
    firsts: dict[tuple[Lib, str], FirstCall] = {}
    # time to first gradient first, while nothing of this size has been compiled; the
    # library that goes first alternates, and the fastest of `first_repeats` counts
    for rep, (m, method) in itertools.product(range(first_repeats), enumerate(METHODS)):
        for lib in LIBS if (index + m + rep) % 2 == 0 else LIBS[::-1]:
            f = first_call(lib, method, cfg, data)
            print(f"    {lib:10s} {method:8s} first gradient {f.seconds:6.2f} s", flush=True)
            best = firsts.get((lib, method))
            if best is None or f.seconds < best.seconds:
                firsts[lib, method] = f
    programs = {
        (lib, method): build_program(lib, method, cfg, data) for method in METHODS for lib in LIBS
    }
    if cfg.model == "GRU":
        programs["etrax", FIXED_WR] = build_program("etrax", FIXED_WR, cfg, data)
    for lib in LIBS:
        programs[lib, USER_CALL] = user_call(lib, CALLED, cfg, data)
    large, large_flops = matmul_program()
    programs["etrax", MATMUL] = Program(large, math.nan, large_flops)
    samples = _interleaved_samples(programs, rounds, min_time)
    rate = large_flops / min(samples.pop(("etrax", MATMUL)))  # the fastest: a floor's rate
    per_call = {key: statistics.median(s) for key, s in samples.items()}
    fixed = per_call.pop(("etrax", FIXED_WR), None)
    calls = {lib: per_call.pop((lib, USER_CALL)) for lib in LIBS}
    measured = {
        key: Measured(
            per_call[key] / T,
            programs[key].scratch_mib,
            firsts[key],
            programs[key].trace_bytes,
            programs[key].chunk,
            programs[key].flops / T,
        )
        for key in per_call
    }
    fixed_wr = None if fixed is None else FixedWr(fixed / T, programs["etrax", FIXED_WR].flops / T)
    return ConfigRun(measured, fixed_wr, calls, rate)


# --- report ------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return "–" if not (b > 0 and math.isfinite(a) and math.isfinite(b)) else f"{a / b:.2f}"


def _zeros(first: FirstCall) -> str:
    return f"{first.zero_leaves}/{first.leaves}"


def _rows(
    results: dict[Config, dict[tuple[Lib, str], Measured]],
) -> tuple[list[list[str]], list[list[str]]]:
    speed, memory = [], []
    for cfg, res in results.items():
        head = [cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch)]
        for method in METHODS:
            e, b = res["etrax", method], res["braintrace", method]
            fe, fb = res["etrax", "forward"], res["braintrace", "forward"]
            speed.append(
                [
                    *head,
                    method,
                    f"{e.step_s * 1e6:,.1f}",
                    f"{b.step_s * 1e6:,.1f}",
                    _ratio(e.step_s, b.step_s),
                    _ratio(e.step_s, fe.step_s),
                    _ratio(b.step_s, fb.step_s),
                ]
            )
            zeros = "–" if method == "forward" else f"{_zeros(e.first)} · {_zeros(b.first)}"
            memory.append(
                [
                    *head,
                    method,
                    f"{e.scratch_mib:,.2f}",
                    f"{b.scratch_mib:,.2f}",
                    f"{e.first.seconds:.2f}",
                    f"{b.first.seconds:.2f}",
                    _ratio(e.first.seconds, b.first.seconds),
                    _ratio(e.first.cpu_seconds, b.first.cpu_seconds),
                    _ratio(e.first.seconds, fe.first.seconds),
                    _ratio(b.first.seconds, fb.first.seconds),
                    f"{e.first.recompiles} · {b.first.recompiles}",
                    zeros,
                ]
            )
    return speed, memory


SPEED_HEADER = [
    "model",
    "L",
    "H",
    "B",
    "method",
    "etrax µs/step",
    "braintrace µs/step",
    "etrax / braintrace",
    "etrax × fwd",
    "braintrace × fwd",
]
MEMORY_HEADER = [
    "model",
    "L",
    "H",
    "B",
    "method",
    "scratch MiB etrax",
    "scratch MiB braintrace",
    "1st grad s etrax",
    "1st grad s braintrace",
    "etrax / braintrace",
    "e / b in CPU time",
    "etrax × fwd",
    "braintrace × fwd",
    "2nd-call compiles e · b",
    "zero-grad leaves e · b",
]


def _device() -> tuple[str, str]:
    dev = jax.devices()[0]
    return dev.platform, getattr(dev, "device_kind", dev.platform)


def _zero_notes(results: dict[Config, dict[tuple[Lib, str], Measured]]) -> str:
    """Which parameter leaves got an all-zero gradient, per model kind and library."""
    seen: dict[tuple[Kind, Lib], dict[str, set[str]]] = {}
    for cfg, res in results.items():
        for (lib, method), m in res.items():
            if method != "forward" and m.first.zero_paths:
                paths = seen.setdefault((cfg.model, lib), {}).setdefault(method, set())
                paths.update(m.first.zero_paths)
    if not seen:
        return "No parameter leaf got an all-zero gradient.\n"
    lines = []
    for (kind, lib), by_method in sorted(seen.items()):
        groups: dict[tuple[str, ...], list[str]] = {}
        for method, paths in by_method.items():
            groups.setdefault(tuple(sorted(paths)), []).append(method)
        for paths_, methods in groups.items():
            names = "`, `".join(paths_)
            lines.append(f"- {kind}, {lib} {' / '.join(methods)}: `{names}`")
    return "All-zero gradients (any size or depth):\n\n" + "\n".join(lines) + "\n"


def _fixed_wr_section(
    results: dict[Config, dict[tuple[Lib, str], Measured]], fixed_wr: dict[Config, FixedWr]
) -> str:
    """etrax's pp-prop with and without the reset-gate gradient beside braintrace's."""
    if not fixed_wr:
        return ""
    rows = []
    for cfg, fixed_run in fixed_wr.items():
        e, b = results[cfg]["etrax", "pp-prop"].step_s, results[cfg]["braintrace", "pp-prop"].step_s
        fe, fixed = results[cfg]["etrax", "forward"].step_s, fixed_run.step_s
        rows.append(
            [
                cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch),
                f"{e * 1e6:,.1f}", f"{fixed * 1e6:,.1f}", f"{b * 1e6:,.1f}",
                _ratio(e, b), _ratio(fixed, b), _ratio(fixed, fe),
            ]
        )  # fmt: skip
    return f"""
## pp-prop with the reset-gate weight fixed

braintrace's pp-prop leaves the GRU reset-gate weight `Wr` at a zero gradient; etrax
computes its exact instantaneous gradient, which costs two weight-sized matrix products
per step (the backward product through `Wh` and the contraction). Here etrax's pp-prop
also runs on the same models with each `Wr` replaced by a constant (`FixedLinear`), so
that both libraries do the same work; interleaved with the rows above.

{table(FIXED_WR_HEADER, rows)}
"""


ONLINE = ("D-RTRL", "pp-prop", "e-prop")


def calls_to_lead(
    first: tuple[float, float], second: tuple[float, float], call: tuple[float, float]
) -> int | None:
    """The number of calls after which the first library's total time (its first
    call, its second, then `call` seconds each) is at most the second's, given as
    ``(first library, second library)`` pairs; `None` if it never is."""
    if first[0] <= first[1]:
        return 1
    behind = first[0] + second[0] - first[1] - second[1]
    if behind <= 0:
        return 2
    gain = call[1] - call[0]
    return None if gain <= 0 else 2 + math.ceil(behind / gain)


def _two_calls_section(results: dict[Config, dict[tuple[Lib, str], Measured]], T: int) -> str:
    """Each library's first and second call of an online learner: the time to first
    gradient, the time until the learner has stopped compiling, and after how many
    calls etrax's total time is below braintrace's."""
    rows = []
    for cfg, res in results.items():
        for method in ONLINE:
            e, b = res["etrax", method], res["braintrace", method]
            lead = calls_to_lead(
                (e.first.seconds, b.first.seconds),
                (e.first.second_seconds, b.first.second_seconds),
                (e.step_s * T, b.step_s * T),
            )
            rows.append(
                [
                    cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch), method,
                    f"{e.first.seconds:.2f}", f"{e.first.second_seconds:.2f}",
                    f"{b.first.seconds:.2f}", f"{b.first.second_seconds:.2f}",
                    _ratio(e.first.seconds, b.first.seconds),
                    _ratio(
                        e.first.seconds + e.first.second_seconds,
                        b.first.seconds + b.first.second_seconds,
                    ),
                    "never" if lead is None else str(lead),
                ]
            )  # fmt: skip
    return f"""
## The first calls of an online learner

The time to first gradient above, and the second call (new input values) of the same
build: a braintrace learner compiles its program again on its second call (its hidden
states are created weakly typed and come back strongly typed), an etrax learner never
does, so "first two" is the time until each learner has stopped compiling. "etrax
ahead after" is the number of {T}-step calls after which etrax's total time (first
call, second call, then the per-step time above × {T} per call) is at most
braintrace's.

{table(TWO_CALLS_HEADER, rows)}
"""


TWO_CALLS_HEADER = [
    "model", "L", "H", "B", "method", "etrax 1st s", "etrax 2nd s", "braintrace 1st s",
    "braintrace 2nd s", "1st: etrax / braintrace", "first two: etrax / braintrace",
    "etrax ahead after (calls)",
]  # fmt: skip


TRACED = ("D-RTRL", "e-prop")
"""The per-parameter rules, whose step is bounded below by their traces' memory traffic."""


def _traffic_section(
    results: dict[Config, dict[tuple[Lib, str], Measured]], bandwidth: float
) -> str:
    """etrax's D-RTRL and e-prop beside the time it takes to read and write their
    traces once per chunk (`traffic_floor_s`), and once per step (a per-step form's
    floor, braintrace's)."""
    rows = []
    for cfg, res in results.items():
        for method in TRACED:
            e = res.get(("etrax", method))
            b = res.get(("braintrace", method))
            if e is None or not e.trace_bytes:
                continue
            floor = traffic_floor_s(e.trace_bytes, e.chunk, bandwidth)
            per_step = traffic_floor_s(e.trace_bytes, 1, bandwidth)
            rows.append(
                [
                    cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch), method,
                    f"{e.trace_bytes / 2**20:,.2f}", str(e.chunk), f"{floor * 1e6:,.1f}",
                    f"{e.step_s * 1e6:,.1f}", _ratio(e.step_s, floor),
                    f"{per_step * 1e6:,.1f}",
                    "–" if b is None else f"{b.step_s * 1e6:,.1f}",
                    "–" if b is None else _ratio(b.step_s, per_step),
                ]
            )  # fmt: skip
    if not rows:
        return ""
    return f"""
## D-RTRL and e-prop against the memory-traffic floor

A per-parameter rule reads and writes every trace at least once per chunk of steps
(etrax's chunked update re-associates a chunk's products, so its traces are touched
once per chunk; a per-step update, braintrace's, touches them at every step). The floor
is `2 × trace bytes / (steps per chunk × bandwidth)`, with the bandwidth of an
element-wise pass over 128 MiB measured in this process: **{bandwidth / 1e9:.1f} GB/s**
(bytes read plus written). "× floor" is how far the step is from it: the rest is
arithmetic (the chunk's products, the forward step, the untraced weights' gradients)
and per-kernel costs. Trace MiB counts every trace the rule carries (e-prop: the
κ-filtered copies too).

{table(TRAFFIC_HEADER, rows)}
"""


def _arithmetic_row(
    head: list[str], method: str, e_flops: float, e_s: float, b: Measured | None, rate: float
) -> list[str]:
    e_floor = e_flops / rate
    b_floor = math.nan if b is None else b.flops / rate
    return [
        *head, method,
        f"{e_flops / 1e6:,.2f}", "–" if b is None else f"{b.flops / 1e6:,.2f}",
        f"{e_floor * 1e6:,.1f}", f"{e_s * 1e6:,.1f}", _ratio(e_s, e_floor),
        "–" if b is None else f"{b_floor * 1e6:,.1f}",
        "–" if b is None else f"{b.step_s * 1e6:,.1f}",
        "–" if b is None else _ratio(b.step_s, b_floor),
        "–" if b is None else _ratio(e_flops, b.flops),
        "–" if b is None else _ratio(e_floor, b.step_s),
    ]  # fmt: skip


def _arithmetic_section(
    results: dict[Config, dict[tuple[Lib, str], Measured]],
    fixed_wr: dict[Config, FixedWr],
    rates: dict[Config, float],
) -> str:
    """Every program's matrix-product arithmetic per step and the time it takes at
    this device's matrix-product rate, timed among the configuration's programs
    (`matmul_program`): a floor no program doing the same products can beat here."""
    rows = []
    for cfg, res in results.items():
        rate = rates[cfg]
        head = [cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch), f"{rate / 1e9:,.1f}"]
        for method in METHODS:
            e, b = res["etrax", method], res.get(("braintrace", method))
            rows.append(_arithmetic_row(head, method, e.flops, e.step_s, b, rate))
            fixed = fixed_wr.get(cfg)
            if method == "pp-prop" and fixed is not None:  # beside braintrace's pp-prop
                rows.append(_arithmetic_row(head, FIXED_WR, fixed.flops, fixed.step_s, b, rate))
    if not rows:
        return ""
    return f"""
## Every method against its matrix products' floor

The floating-point operations of every matrix product a program runs per step,
counted in XLA's optimised program (what XLA removed as dead code is not counted;
a loop body counts once per iteration), and the time they take at the rate of one
float32 2,048 × 2,048 product on this device (8,192 on a GPU): the fastest of its
samples in the same interleaved rounds as the configuration's programs (so a drift
of a shared machine's speed moves the floor with the steps). A large product is the
best case: a step's own products, with a batch of rows, run slower, so "× floor",
how far a step is from that time, stays above 1 even for a step that is nothing but
its products; only fewer products can bring the floor down. The last two columns:
etrax's product arithmetic against braintrace's (for pp-prop on the GRU models above
1 by the two products of `Wr`'s exact gradient that braintrace does not compute;
the `{FIXED_WR}` row is etrax without them), and etrax's floor against braintrace's
measured step (above 1, no etrax step could match braintrace's on this device).

{table(ARITHMETIC_HEADER, rows)}
"""


ARITHMETIC_HEADER = [
    "model", "L", "H", "B", "GFLOP/s", "method", "etrax MFLOP/step", "braintrace MFLOP/step",
    "etrax floor µs/step", "etrax µs/step", "etrax × floor", "braintrace floor µs/step",
    "braintrace µs/step", "braintrace × floor", "MFLOP etrax / braintrace",
    "etrax floor / braintrace µs/step",
]  # fmt: skip


TRAFFIC_HEADER = [
    "model", "L", "H", "B", "method", "trace MiB", "steps per chunk", "floor µs/step",
    "etrax µs/step", "etrax × floor", "per-step floor µs/step", "braintrace µs/step",
    "braintrace × per-step floor",
]  # fmt: skip


USER_CALL = "user call"


def _user_call_section(
    results: dict[Config, dict[tuple[Lib, str], Measured]],
    calls: dict[Config, dict[Lib, float]],
    T: int,
) -> str:
    """Each library's `CALLED` call through its user path beside etrax's program."""
    if not calls:
        return ""
    rows = []
    for cfg, by_lib in calls.items():
        e, b = by_lib["etrax"], by_lib["braintrace"]
        program = results[cfg]["etrax", CALLED].step_s * T
        rows.append(
            [
                cfg.model, str(cfg.layers), str(cfg.hidden), str(cfg.batch),
                f"{e * 1e6:,.0f}", f"{b * 1e6:,.0f}", _ratio(e, b), f"{program * 1e6:,.0f}",
            ]
        )  # fmt: skip
    return f"""
## {CALLED} per call through the user path

One {T}-step gradient call as a training loop makes it, Python included: etrax's
`learner.etrace_grad` (which also reads the model's states, writes the new hidden
values back and checks for a silent network) and braintrace's jitted `etrace_grad`;
interleaved with the rows above. "etrax program" is the executable of the per-step
table, for scale: it is not the learner's own program (which returns other outputs),
so at large sizes a call can take less.

{table(USER_CALL_HEADER, rows)}
"""


USER_CALL_HEADER = [
    "model", "L", "H", "B", "etrax µs/call", "braintrace µs/call", "etrax / braintrace",
    "etrax program µs/call",
]  # fmt: skip


FIXED_WR_HEADER = [
    "model", "L", "H", "B", "etrax pp-prop µs/step", "etrax, Wr fixed µs/step",
    "braintrace pp-prop µs/step", "etrax / braintrace", "etrax Wr fixed / braintrace",
    "etrax Wr fixed × fwd",
]  # fmt: skip


def report(
    results: dict[Config, dict[tuple[Lib, str], Measured]],
    fixed_wr: dict[Config, FixedWr],
    calls: dict[Config, dict[Lib, float]],
    T: int,
    rounds: int,
    first_repeats: int,
    matrix: str,
    bandwidth: float,
    rates: dict[Config, float],
) -> str:
    platform, kind = _device()
    speed, memory = _rows(results)
    return f"""# etrax vs braintrace {braintrace.__version__}, side by side ({platform}: {kind})

`python benchmarks/run.py peer --matrix {matrix}`: jax {jax.__version__}, brainstate
{brainstate.__version__}, braintrace {braintrace.__version__}, etrax {etrax.__version__};
float32, T = {T} steps per call, median of {rounds} interleaved rounds. Timings on shared
machines are noisy: compare ratios within this table, not absolute times across runs.

- **Models.** `GRU`/`LSTM`: L stacked cells (`etrax.nn.GRUCell`/`LSTMCell` vs
  `braintrace.nn.GRUCell`/`LSTMCell`, the same gate layout: one `Linear([x; h] → H)` per
  gate) → `Linear(H, 1)`. `LIF`/`ALIF`: L recurrent spiking layers
  `s_l = neuron(W_in s_(l−1) + W_rec s_l^(t−1))` → `Linear(H, 1)`, with `etrax.nn.LIF`/`ALIF`
  on the etrax side and, on the braintrace side (which ships no neurons; its
  `nn.LIF` forwards to brainpy.state's, which carries units and an exponential-Euler
  integrator), a plain brainstate module with the same equations and surrogate. Input
  10 features, per-step MSE.
- **Methods.** forward: the model's brainstate `update` in a `lax.scan`
  (`brainstate.transform.StatefulFunction`, no Jacobians); BPTT: `jax.grad` over it.
  etrax: `online_grad` with `DRTRL()`, `PPProp({DECAY})`, `EProp({KAPPA})`; braintrace:
  `compile(model, D_RTRL | pp_prop(decay_or_rank={DECAY}) | EProp(kappa_filter_decay={KAPPA}))`
  and `etrace_grad`. × fwd is relative to the same library's forward step.
- **Per-step time**: the AOT-compiled executable of one T-step call (no Python
  dispatch), divided by T; etrax's online programs with its learner's default
  options (`etrax.algorithms.default_compiler_options`). **Scratch**: XLA's
  `memory_analysis().temp_size_in_bytes` of that executable (arguments, outputs and
  trace state excluded).
- **1st grad**: each library's user path from a model with weights: graph compile,
  tracing, XLA compile and the first call returning gradients (etrax:
  `etrax.compile` + `learner.etrace_grad`; braintrace: `braintrace.compile` +
  `brainstate.transform.jit(etrace_grad)`; forward/BPTT: `jax.jit` of the scans), in
  wall-clock seconds, the fastest of {first_repeats} fresh build(s), each from cleared
  JAX caches (`jax.clear_caches()`: no build reuses an earlier one's traces or XLA
  programs); the ratio is also
  given in this process's CPU time. Few samples: expect ±50 % on a shared machine.
  **2nd-call compiles**: XLA compilations triggered by a second call with new input
  values (should be 0).
- **Zero-grad leaves**: parameter leaves whose gradient is identically zero after the
  first call. braintrace's single-step mode gives its readout (`out.weight`,
  `out.bias`) and the GRU reset gate `Wr` a zero gradient, so its online methods skip
  work that etrax does (etrax computes their exact instantaneous gradients).

{_zero_notes(results)}
## Per-step time

{table(SPEED_HEADER, speed)}

## Compiled scratch memory and time to first gradient

{table(MEMORY_HEADER, memory)}
{_two_calls_section(results, T)}{_fixed_wr_section(results, fixed_wr)}\
{_user_call_section(results, calls, T)}{_traffic_section(results, bandwidth)}\
{_arithmetic_section(results, fixed_wr, rates)}"""


def plot(results: dict[Config, dict[tuple[Lib, str], Measured]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    platform, kind = _device()
    labels = [cfg.label for cfg in results]
    x = np.arange(len(labels))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
    colors = dict(zip(METHODS[1:], ["tab:gray", "tab:red", "tab:blue", "tab:green"], strict=True))
    for method, color in colors.items():
        styles: tuple[tuple[Lib, str, str], ...] = (
            ("etrax", "o", color),
            ("braintrace", "s", "none"),
        )
        for lib, marker, fill in styles:
            ys = [r[lib, method].step_s / r[lib, "forward"].step_s for r in results.values()]
            left.plot(
                x,
                ys,
                marker=marker,
                color=color,
                mfc=fill,
                ls="-" if lib == "etrax" else ":",
                label=f"{lib} {method}",
            )
        ratio = [
            r["etrax", method].step_s / r["braintrace", method].step_s for r in results.values()
        ]
        right.plot(x, ratio, marker="o", color=color, label=method)
    for ax in (left, right):
        ax.set_yscale("log")
        ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    left.set_ylabel("per-step time / same library's forward step")
    left.set_title("cost over the forward step")
    left.legend(fontsize=7, ncol=2)
    right.axhline(1.0, color="k", lw=0.8)
    right.set_ylabel("etrax time / braintrace time (below 1: etrax faster)")
    right.set_title("etrax vs braintrace per step")
    right.legend(fontsize=8)
    fig.suptitle(f"etrax vs braintrace {braintrace.__version__} ({platform}: {kind})")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- entry point -------------------------------------------------------------------


def _parse_config(text: str) -> Config:
    model, layers, hidden, batch = text.split(":")
    if model not in ("GRU", "LSTM", "LIF", "ALIF"):
        raise argparse.ArgumentTypeError(f"model must be GRU, LSTM, LIF or ALIF, got {model!r}")
    kind: Kind = model  # type: ignore[assignment]
    return Config(kind, int(layers), int(hidden), int(batch))


def add_timing_options(parser: argparse.ArgumentParser, *, steps: int, rounds: int) -> None:
    """``--steps``, ``--rounds``, ``--min-time`` and ``--out``, for the suites that time
    compiled programs in interleaved rounds (`_interleaved`) and write one table."""
    parser.add_argument("--steps", type=int, default=steps, help="T, steps per call")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds per sample")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")


def add_only_option(parser: argparse.ArgumentParser) -> None:
    """``--only MODEL:L:H:B ...``: these configurations instead of the suite's own."""
    parser.add_argument(
        "--only",
        type=_parse_config,
        nargs="+",
        default=None,
        metavar="MODEL:L:H:B",
        help="these configurations instead, e.g. GRU:1:512:32",
    )


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run.py peer", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--matrix",
        choices=sorted(MATRICES),
        default=None,
        help="configurations (default: gpu on a GPU, else cpu)",
    )
    parser.add_argument("--full", action="store_true", help="the whole matrix (--matrix full)")
    add_only_option(parser)
    parser.add_argument(
        "--steps", type=int, default=None, help="T, steps per call (default: 32 on CPU, else 64)"
    )
    parser.add_argument(
        "--first-repeats",
        type=int,
        default=None,
        help="fresh builds per time to first gradient; the fastest counts (default: CPU 2, else 1)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds per timing sample")
    parser.add_argument(
        "--budget",
        type=float,
        default=math.inf,
        help="start no new configuration after this many seconds",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    return parser.parse_args(list(argv))


def run(argv: Sequence[str] = ()) -> str:
    args = _arguments(argv)
    platform, _ = _device()
    matrix = "full" if args.full else args.matrix or ("gpu" if platform == "gpu" else "cpu")
    configs: list[Config] = args.only or MATRICES[matrix]
    steps: int = args.steps or (32 if platform == "cpu" else 64)
    first_repeats: int = args.first_repeats or (2 if platform == "cpu" else 1)
    if args.only:
        matrix = "custom"
    tag = "cpu" if platform == "cpu" else "gpu" if platform == "gpu" else platform
    args.out.mkdir(parents=True, exist_ok=True)
    md, png = args.out / f"peer_{tag}.md", args.out / f"peer_{tag}.png"
    results: dict[Config, dict[tuple[Lib, str], Measured]] = {}
    fixed_wr: dict[Config, FixedWr] = {}
    calls: dict[Config, dict[Lib, float]] = {}
    rates: dict[Config, float] = {}
    start = time.perf_counter()
    text = ""
    bandwidth = stream_bandwidth()
    print(f"  memory bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s", flush=True)
    with warnings.catch_warnings():
        # braintrace reports every weight without a hidden relation as a warning
        warnings.simplefilter("ignore")
        for i, cfg in enumerate(_warm_up(configs)):
            if time.perf_counter() - start > args.budget:
                left = len(configs) - i
                print(f"  budget of {args.budget:.0f} s spent: {left} configuration(s) left out")
                break
            print(f"  {cfg.label}", flush=True)
            done = measure(cfg, i, steps, args.rounds, args.min_time, first_repeats)
            results[cfg], calls[cfg], rates[cfg] = done.measured, done.calls, done.rate
            if done.fixed is not None:
                fixed_wr[cfg] = done.fixed
            _clear_caches()
            text = report(
                results, fixed_wr, calls, steps, args.rounds, first_repeats, matrix, bandwidth,
                rates,
            )  # fmt: skip
            md.write_text(text)  # after every configuration, so a cut-off run keeps its rows
            plot(results, png)
    print(f"wrote {md} and {png} ({time.perf_counter() - start:.0f} s)")
    return text


def _clear_caches() -> None:
    jax.clear_caches()  # type: ignore[no-untyped-call]


def _warm_up(configs: list[Config]) -> Iterator[Config]:
    """Run a tiny configuration through both libraries first (its numbers are dropped),
    so one-off costs of the first compile in the process count for neither."""
    small = Config("GRU", 1, 8, 1)
    data = make_data(small, 4)
    for lib, method in itertools.product(LIBS, METHODS):
        first_call(lib, method, small, data)
    _clear_caches()
    yield from configs
