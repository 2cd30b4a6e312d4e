"""The layer zoo: structure of each layer's graph, its Jacobians against the
`jax.jacrev` oracle, and exactness of D-RTRL where the recurrence is diagonal."""

from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike

import etrax
from etrax import DiagnosticKind as K

from .models import ModelCase, build
from .oracles import OracleJacobians, random_state_values
from .typechecks import unchecked

TOL = 1e-10


class ConvLIF(brainstate.nn.Module):
    """Conv1d → LIF (→ Conv1d → LIF) → readout (spiking, channel-last, batch 2)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        w = brainstate.nn.init.KaimingNormal(scale=6.0)
        self.c1 = etrax.nn.Conv1d(2, 3, 3, w_init=w)
        self.n1 = etrax.nn.LIF((6, 3), tau=5.0)
        self.deep = depth > 1
        if self.deep:
            self.c2 = etrax.nn.Conv1d(3, 2, 3, w_init=w)
            self.n2 = etrax.nn.LIF((6, 2), tau=5.0)
        self.out = etrax.nn.Linear(2 if self.deep else 3, 1)

    def update(self, x: ArrayLike) -> Array:
        s = self.n1(self.c1(x))
        if self.deep:
            s = self.n2(self.c2(s))
        y: Array = self.out(s)
        return y


class Leaky(brainstate.nn.Module):
    """``h ← 0.5 h + layer(x)`` around any feed-forward layer."""

    def __init__(self, layer: brainstate.nn.Module, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.layer = layer
        self.shape = hidden

    def init_state(self, batch_size: int | None = None, **kw: object) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.shape, brainstate.environ.dftype()))

    def update(self, x: ArrayLike) -> Array:
        h: Array = 0.5 * self.h.value + self.layer(x)
        self.h.value = h
        return h


def _lif_conv(depth: int) -> tuple[brainstate.nn.Module, Any]:
    model = ConvLIF(depth)
    brainstate.nn.init_all_states(model, batch_size=2)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 2), brainstate.environ.dftype())
    return model, x


def _leaky(
    layer: brainstate.nn.Module, hidden: tuple[int, ...], x: Array
) -> tuple[brainstate.nn.Module, Any]:
    model = Leaky(layer, hidden)
    brainstate.nn.init_all_states(model)
    return model, x


def _x(shape: tuple[int, ...]) -> Array:
    return jax.random.normal(jax.random.PRNGKey(1), shape, brainstate.environ.dftype())


LAYERS = (
    ModelCase("lru", lambda: build(etrax.nn.LRUCell, 3, 4), True, True),
    ModelCase("lru_b2", lambda: build(etrax.nn.LRUCell, 3, 4, batch=2), True, True),
    ModelCase("urlstm", lambda: build(etrax.nn.URLSTMCell, 3, 4), False),
    ModelCase("minilstm", lambda: build(etrax.nn.MiniLSTM, 3, 4), False),
    ModelCase("minimalrnn", lambda: build(etrax.nn.MinimalRNNCell, 3, 4), False),
    ModelCase("cfn", lambda: build(etrax.nn.CFNCell, 3, 4), False),
    ModelCase("conv_lif", lambda: _lif_conv(1), True, True),
    # Stacked: the second layer's state depends on the first's within a step, so
    # the per-group (diagonal) traces are an approximation there.
    ModelCase("conv_lif_stacked", lambda: _lif_conv(2), True, False),
    ModelCase(
        "conv2d",
        lambda: _leaky(etrax.nn.Conv2d(2, 3, (3, 2)), (2, 4, 5, 3), _x((2, 4, 5, 2))),
        True,
        True,
    ),
    ModelCase(
        "conv3d",
        lambda: _leaky(etrax.nn.Conv3d(1, 2, 2, stride=2), (1, 2, 2, 2, 2), _x((1, 4, 4, 4, 1))),
        True,
        True,
    ),
    ModelCase(
        "sparse",
        lambda: _leaky(etrax.nn.SparseLinear(5, 4, density=0.5), (2, 4), _x((2, 5))),
        True,
        True,
    ),
    ModelCase(
        "grouped",
        lambda: _leaky(etrax.nn.GroupedLinear(2, 3, 4), (2, 2, 4), _x((2, 2, 3))),
        True,
        True,
    ),
    ModelCase(
        "lora",
        lambda: _leaky(etrax.nn.LoRA(5, 2, 4, alpha=0.5), (2, 4), _x((2, 5))),
        True,
        True,
    ),
    ModelCase(
        "embedding",
        lambda: _leaky(etrax.nn.Embedding(7, 4), (3, 4), jnp.asarray([1, 5, 1])),
        True,
        True,
    ),
)


def test_layer_structure() -> None:
    def graph_of(case_name: str) -> etrax.ETraceGraph:
        model, x = next(c for c in LAYERS if c.name == case_name).make()
        return etrax.compile_etrace_graph(model, x)

    lru = graph_of("lru")
    assert [(g.hidden_paths, g.num_state) for g in lru.hidden_groups] == [
        ((("h_re",), ("h_im",)), 2)
    ]
    assert {r.weight_path for r in lru.hidden_param_op_relations} == {
        ("nu_log",),
        ("theta_log",),
        ("gamma_log",),
        ("B_re", "weight"),
        ("B_im", "weight"),
    }
    assert {r.weight_path for r in lru.explain(kind=K.RELATION_EXCLUDED_NON_TEMPORAL)} == {
        ("C_re", "weight"),
        ("C_im", "weight"),
        ("D",),
    }
    ur = graph_of("urlstm")
    assert [g.hidden_paths for g in ur.hidden_groups] == [(("h",), ("c",))]
    assert len(ur.hidden_param_op_relations) == 5
    assert {r.weight_path for r in graph_of("minilstm").hidden_param_op_relations} == {
        ("W_f", "weight"),
        ("W_i", "weight"),
        ("W_x", "weight"),
    }
    minimal = graph_of("minimalrnn")
    assert [r.weight_path for r in minimal.explain(kind=K.RELATION_PARTIAL_PATH)] == [
        ("phi", "weight")
    ]
    assert len(graph_of("cfn").hidden_param_op_relations) == 3
    conv = graph_of("conv_lif_stacked")
    assert [g.hidden_paths for g in conv.hidden_groups] == [(("n1", "V"),), (("n2", "V"),)]
    assert [(r.primitive.name, r.hidden_groups) for r in conv.hidden_param_op_relations] == [
        ("etp_conv", (0,)),
        ("etp_conv", (1,)),
    ]


@pytest.mark.parametrize("case", LAYERS, ids=lambda c: c.name)
def test_layer_jacobians_match_jacrev(case: ModelCase) -> None:
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    values = random_state_values(graph)
    state = etrax.state_of(graph).replace_hidden(
        {p: values[p] for p in graph.module_info.hidden_paths}
    )
    _, _, jac = etrax.step(graph, state, x)
    oracle = OracleJacobians(graph, model, x, values, case.diagonal)
    for got, expected in zip(jac.D, oracle.D, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
    for r in range(len(graph.hidden_param_op_relations)):
        for got, expected in zip(jac.df[r], oracle.df[r], strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)


def _mse(y: Array, t: Array) -> Array:
    return jnp.sum((y - t) ** 2)


@pytest.mark.parametrize("case", [c for c in LAYERS if c.exact_online], ids=lambda c: c.name)
def test_drtrl_exact_on_diagonal_layers(case: ModelCase) -> None:
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    T = 4
    if jnp.issubdtype(x.dtype, jnp.integer):
        xs = jax.random.randint(jax.random.PRNGKey(2), (T, *x.shape), 0, 7)
    else:
        xs = jax.random.normal(jax.random.PRNGKey(2), (T, *x.shape), x.dtype)
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(3), (T, *y0.shape), y0.dtype)
    expected, _ = etrax.bptt_grad(graph, state, xs, ts, _mse)
    got, _ = etrax.online_grad(
        graph, etrax.DRTRL(), state, etrax.DRTRL().init(graph, state), xs, ts, _mse
    )
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        scale = float(jnp.max(jnp.abs(v))) or 1.0
        assert float(jnp.max(jnp.abs(u - v))) / scale <= TOL


@pytest.mark.parametrize("case", LAYERS, ids=lambda c: c.name)
def test_layers_train_online_with_pp_prop(case: ModelCase) -> None:
    """Every layer runs under ES-D-RTRL with finite, non-zero gradients shaped like
    its parameters."""
    model, x = case.make()
    graph = etrax.compile_etrace_graph(model, x)
    state = etrax.state_of(graph)
    if jnp.issubdtype(x.dtype, jnp.integer):
        xs = jax.random.randint(jax.random.PRNGKey(2), (3, *x.shape), 0, 7)
    else:
        xs = jax.random.normal(jax.random.PRNGKey(2), (3, *x.shape), x.dtype)
    y0, _ = etrax.forward(graph, state, x)
    ts = jax.random.normal(jax.random.PRNGKey(3), (3, *y0.shape), y0.dtype)
    algo = etrax.PPProp(decay=0.9)
    grads, _ = etrax.online_grad(graph, algo, state, algo.init(graph, state), xs, ts, _mse)

    def shapes(tree: object) -> list[tuple[str, tuple[int, ...]]]:
        return [(jax.tree_util.keystr(k), jnp.shape(v)) for k, v in jax.tree.leaves_with_path(tree)]

    assert shapes(grads) == shapes(state.params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads))


def test_neuron_size_validation() -> None:
    assert etrax.nn.LIF((6, 3)).size == (6, 3)
    assert etrax.nn.ALIF(4).size == (4,)
    with pytest.raises(ValueError, match=r"size\[1\] must be a positive int, got 0"):
        etrax.nn.LIF((3, 0))
    with pytest.raises(ValueError, match="size must be"):
        etrax.nn.ALIF(())
    with pytest.raises(TypeError):
        etrax.nn.LIF(2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (
            lambda v: etrax.nn.GRUCell(v, 4),
            ValueError,
            "GRUCell: num_in must be a positive int, got 0",
        ),
        (lambda v: etrax.nn.LSTMCell(3, v), ValueError, "LSTMCell: num_out must be a positive int"),
        (
            lambda v: etrax.nn.Linear(v, 3),
            ValueError,
            "Linear: in_size must be a positive int, got 0",
        ),
        (lambda v: etrax.nn.Linear(3, (2, v)), ValueError, r"Linear: out_size\[-1\] must be"),
        (lambda v: etrax.nn.Conv2d(v, 3, 3), ValueError, "Conv2d: in_channels must be"),
        (lambda v: etrax.nn.Embedding(v, 3), ValueError, "Embedding: num_embeddings must be"),
        (lambda v: etrax.nn.LoRA(3, v, 2), ValueError, "LoRA: rank must be a positive int"),
        (lambda v: etrax.nn.GroupedLinear(v, 3, 2), ValueError, "GroupedLinear: groups must be"),
        (lambda v: etrax.nn.SparseLinear(3, v), ValueError, "SparseLinear: out_size must be"),
        (lambda v: etrax.nn.LRUCell(v, 3), ValueError, "LRUCell: d_model must be"),
        (lambda v: etrax.nn.LeakyRateReadout(3, v), ValueError, "LeakyRateReadout: out_size"),
    ],
)
def test_layer_sizes_are_checked_by_the_layer(make: Any, error: type, pattern: str) -> None:
    """A size of zero (or less) is a `ValueError` naming the layer and the argument, and
    a size that is not an integer a `TypeError` (not a failure deep in the
    initialiser or in XLA); NumPy integers are sizes too."""
    with pytest.raises(error, match=pattern):
        make(0)
    with pytest.raises(ValueError, match="positive int"):
        make(-2)
    with unchecked():  # a user without the suite's runtime type checks
        with pytest.raises(TypeError, match=r"must be a positive int, got (float 2\.5|str 'a')"):
            make(2.5)
        with pytest.raises(TypeError, match="must be a positive int, got bool"):
            make(True)
        make(np.int64(2))


@pytest.mark.parametrize("batch_size", [None, 3])
def test_zero_states_are_made_without_compiling(batch_size: int | None) -> None:
    """Unitless zero initial states are made in NumPy (no XLA program per new shape)
    and equal brainstate's own."""
    from etrax.nn._common import init_param

    from .compiles import CompileCount

    shape = (7, 11)  # a shape no other test creates
    with CompileCount() as counted:
        got = init_param(brainstate.nn.init.ZeroInit(), shape, batch_size)
    want = brainstate.nn.init.param(brainstate.nn.init.ZeroInit(), shape, batch_size)
    assert counted.count == 0
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(got, want)
