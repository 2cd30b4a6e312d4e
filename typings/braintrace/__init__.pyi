# Stub for braintrace 0.2.6: covers only the surface benchmarks/bench_peer.py uses
# (the peer library measured side by side with etrax). braintrace is installed only
# in the `bench` nox session, so mypy in the typecheck environment reads this stub.

from typing import Any

import brainstate

from . import nn as nn

__version__: str

class ETraceAlgorithm(brainstate.nn.Module):
    """A compiled online learner: calling it runs one model step and updates the traces."""

    def update(self, *args: Any) -> Any: ...
    def etrace_grad(
        self,
        *sequences: Any,
        step_fn: Any,
        mask: Any = None,
        chunk_size: int | None = None,
        weights: Any = None,
        reduction: str = "mean",
        loss_output: str = "per_step",
        has_aux: bool = False,
        return_value: bool = False,
    ) -> Any: ...

class ParamDimVjpAlgorithm(ETraceAlgorithm): ...
class IODimVjpAlgorithm(ETraceAlgorithm): ...
class D_RTRL(ParamDimVjpAlgorithm): ...
class pp_prop(IODimVjpAlgorithm): ...
class EProp(ParamDimVjpAlgorithm): ...

ES_D_RTRL = pp_prop

def compile(
    model: brainstate.nn.Module,
    algorithm: str | type[ETraceAlgorithm],
    *example_inputs: Any,
    batch_size: int | None = None,
    seed: int | None = None,
    verbose: int = 0,
    vmap: bool = False,
    **options: Any,
) -> ETraceAlgorithm: ...
