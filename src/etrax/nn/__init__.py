"""Layers whose weights etrax traces: brainstate modules built on etrax ops."""

from ._linear import Linear
from ._readout import LeakyRateReadout
from ._rnn import GRUCell, LSTMCell, MGUCell, MiniGRU, ValinaRNNCell, VanillaRNNCell

__all__ = [
    "GRUCell",
    "LSTMCell",
    "LeakyRateReadout",
    "Linear",
    "MGUCell",
    "MiniGRU",
    "ValinaRNNCell",
    "VanillaRNNCell",
]
