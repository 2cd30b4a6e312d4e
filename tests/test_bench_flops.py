"""The benchmarks' count of matrix-product arithmetic (`benchmarks/_flops.py`): exact
on programs whose products are known, loops counted per iteration, the costlier
branch of a conditional, and a loop of unknown length refused."""

import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

FLOPS = Path(__file__).parents[1] / "benchmarks" / "_flops.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("etrax_bench_flops", FLOPS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flops = _module()


def _count(fn: Any, *args: Any) -> float:
    text = jax.jit(fn).lower(*args).compile().as_text()
    assert text is not None
    count: float = flops.product_flops(text)
    return count


def _ones(*shape: int) -> jax.Array:
    return jnp.linspace(0.0, 1.0, num=int(jnp.prod(jnp.array(shape)))).reshape(shape)


def test_one_product() -> None:
    assert _count(lambda a, b: jnp.tanh(a @ b), _ones(8, 16), _ones(16, 24)) == 2 * 8 * 16 * 24


def test_batched_product() -> None:
    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum("bij,bjk->bik", a, b)

    assert _count(f, _ones(3, 8, 16), _ones(3, 16, 24)) == 2 * 3 * 8 * 16 * 24


def test_scans_count_each_iteration() -> None:
    def inner(h: jax.Array, w: jax.Array) -> jax.Array:
        def body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
            return jnp.tanh(c @ w), None

        return jax.lax.scan(body, h, None, length=5)[0]

    def outer(h: jax.Array, w: jax.Array, v: jax.Array) -> jax.Array:
        def body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
            return jnp.sin(inner(c, w) @ v), None

        return jax.lax.scan(body, h, None, length=3)[0]

    got = _count(outer, _ones(8, 16), _ones(16, 16), _ones(16, 16))
    assert got == 3 * (5 + 1) * 2 * 8 * 16 * 16


def test_conditional_counts_its_costliest_branch() -> None:
    def f(p: jax.Array, a: jax.Array, w: jax.Array) -> jax.Array:
        out: jax.Array = jax.lax.cond(p, lambda x: jnp.tanh(jnp.tanh(x @ w) @ w), jnp.sin, a)
        return out

    assert _count(f, jnp.array(True), _ones(8, 16), _ones(16, 16)) == 2 * (2 * 8 * 16 * 16)


def test_a_loop_of_unknown_length_is_refused() -> None:
    def f(n: jax.Array, a: jax.Array, w: jax.Array) -> jax.Array:
        out: jax.Array = jax.lax.fori_loop(0, n, lambda _, x: jnp.tanh(x @ w), a)
        return out

    with pytest.raises(ValueError, match="known trip count"):
        _count(f, jnp.array(4), _ones(8, 16), _ones(16, 16))


def test_the_large_product_is_one_product_of_its_stated_arithmetic() -> None:
    """`matmul_program`: the product ``a @ a`` it runs, and the operations it states
    are those its compiled program holds (the benchmark's rate divides them by its
    time)."""
    run, stated = flops.matmul_program(n=64)
    a = jax.random.normal(jax.random.PRNGKey(0), (64, 64), jnp.float32)
    np.testing.assert_allclose(run(), a @ a, rtol=1e-5, atol=1e-4)
    assert stated == 2 * 64**3
    assert flops.product_flops(run.func.as_text()) == stated


_DIMS = (
    '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}'
)


def _gemm(name: str, result: str, args: str) -> str:
    return (
        f"  %{name} = ({result}, s8[1024]{{0}}) custom-call({args}), "
        f'custom_call_target="__cublas$gemm", '
        f'backend_config={{"gemm_backend_config":{{"alpha_real":1,{_DIMS}}}}}'
    )


GPU_MODULE = "\n".join(
    [
        "HloModule jit_f",
        "",
        "%body (p: (s32[], f32[32,512])) -> (s32[], f32[32,512]) {",
        "  %p = (s32[], f32[32,512]{1,0}) parameter(0)",
        "  %w = f32[512,512]{1,0} constant({...})",
        "  %h = f32[32,512]{1,0} get-tuple-element(%p), index=1",
        _gemm("g", "f32[32,512]{1,0}", "%h, %w"),
        "  ROOT %t = (s32[], f32[32,512]{1,0}) tuple(%i, %r)",
        "}",
        "",
        "%cond (p.1: (s32[], f32[32,512])) -> pred[] {",
        "  %p.1 = (s32[], f32[32,512]{1,0}) parameter(0)",
        "  ROOT %lt = pred[] constant(true)",
        "}",
        "",
        "ENTRY %main (a: f32[32,522], b: f32[522,512]) -> f32[32,512] {",
        "  %a = f32[32,522]{1,0} parameter(0)",
        "  %b = f32[522,512]{1,0} parameter(1)",
        _gemm("first", "f32[32,512]{1,0}", "%a, %b"),
        "  %w.1 = (s32[], f32[32,512]{1,0}) while(%init), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"7"}}',
        "  ROOT %out = f32[32,512]{1,0} get-tuple-element(%w.1), index=1",
        "}",
    ]
)


def test_gemm_library_calls_count_as_products() -> None:
    """A GPU program's products are cuBLAS calls, not ``dot`` instructions (written
    out here: this machine has no GPU to compile one)."""
    expected = 2 * 32 * 522 * 512 + 7 * 2 * 32 * 512 * 512
    assert flops.product_flops(GPU_MODULE) == expected
