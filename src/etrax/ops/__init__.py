"""ETP operations: the weight operations whose influence on hidden states etrax traces."""

from ._elementwise import element_wise, element_wise_p
from ._matmul import matmul, matmul_p
from ._primitive import (
    ETPOpSpec,
    ETPRules,
    Factorization,
    etp_spec,
    is_etp_primitive,
    register_primitive,
    register_rules,
    registered_primitives,
)

__all__ = [
    "ETPOpSpec",
    "ETPRules",
    "Factorization",
    "element_wise",
    "element_wise_p",
    "etp_spec",
    "is_etp_primitive",
    "matmul",
    "matmul_p",
    "register_primitive",
    "register_rules",
    "registered_primitives",
]
