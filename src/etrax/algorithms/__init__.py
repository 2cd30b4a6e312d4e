"""Online learning: pure algorithms (D-RTRL, pp-prop, e-prop) and sequence drivers."""

from ._base import EffGrads, OnlineAlgorithm
from ._check import (
    GradientCheck,
    ParamCheck,
    check_gradients,
    compare_gradients,
    t1_tolerance,
)
from ._drivers import bptt_grad, online_grad
from ._drtrl import DRTRL, DRTRLTraces, EProp, EPropTraces
from ._learner import OnlineLearner, compile
from ._pp import ESDRTRL, PPProp, PPTraces
from ._weights import operand_values, operands_to_params

__all__ = [
    "DRTRL",
    "ESDRTRL",
    "DRTRLTraces",
    "EProp",
    "EPropTraces",
    "EffGrads",
    "GradientCheck",
    "OnlineAlgorithm",
    "OnlineLearner",
    "PPProp",
    "PPTraces",
    "ParamCheck",
    "bptt_grad",
    "check_gradients",
    "compare_gradients",
    "compile",
    "online_grad",
    "operand_values",
    "operands_to_params",
    "t1_tolerance",
]
