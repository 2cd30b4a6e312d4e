# Stub for braintrace.nn: the layers benchmarks/bench_peer.py builds its models from.

from typing import Any

import brainstate

class Linear(brainstate.nn.Module):
    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Any = ...,
        b_init: Any = ...,
        w_mask: Any = None,
        name: str | None = None,
    ) -> None: ...
    def update(self, x: Any) -> Any: ...

class _Cell(brainstate.nn.Module):
    def __init__(
        self,
        in_size: int,
        out_size: int,
        w_init: Any = ...,
        b_init: Any = ...,
        state_init: Any = ...,
        activation: Any = "tanh",
        name: str | None = None,
    ) -> None: ...
    def update(self, x: Any) -> Any: ...

class GRUCell(_Cell): ...
class LSTMCell(_Cell): ...
