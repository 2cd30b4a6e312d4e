"""Layers whose weights etrax traces: brainstate modules built on etrax ops."""

from ._cells import CFNCell, LRUCell, MiniLSTM, MinimalRNNCell, URLSTMCell
from ._linear import Linear
from ._neurons import ALIF, LIF
from ._readout import LeakyRateReadout
from ._rnn import GRUCell, LSTMCell, MGUCell, MiniGRU, ValinaRNNCell, VanillaRNNCell
from ._surrogate import ReluGrad, SigmoidGrad, Surrogate, spike
from ._zoo import Conv1d, Conv2d, Conv3d, Embedding, GroupedLinear, LoRA, SparseLinear

__all__ = [
    "ALIF",
    "LIF",
    "CFNCell",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "Embedding",
    "GRUCell",
    "GroupedLinear",
    "LRUCell",
    "LSTMCell",
    "LeakyRateReadout",
    "Linear",
    "LoRA",
    "MGUCell",
    "MiniGRU",
    "MiniLSTM",
    "MinimalRNNCell",
    "ReluGrad",
    "SigmoidGrad",
    "SparseLinear",
    "Surrogate",
    "URLSTMCell",
    "ValinaRNNCell",
    "VanillaRNNCell",
    "spike",
]
