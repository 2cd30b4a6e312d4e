"""Layers whose weights etrax traces: brainstate modules built on etrax ops."""

from ._linear import Linear
from ._neurons import ALIF, LIF
from ._readout import LeakyRateReadout
from ._rnn import GRUCell, LSTMCell, MGUCell, MiniGRU, ValinaRNNCell, VanillaRNNCell
from ._surrogate import ReluGrad, SigmoidGrad, Surrogate, spike

__all__ = [
    "ALIF",
    "LIF",
    "GRUCell",
    "LSTMCell",
    "LeakyRateReadout",
    "Linear",
    "MGUCell",
    "MiniGRU",
    "ReluGrad",
    "SigmoidGrad",
    "Surrogate",
    "ValinaRNNCell",
    "VanillaRNNCell",
    "spike",
]
