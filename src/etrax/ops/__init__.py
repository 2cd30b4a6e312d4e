"""ETP operations: the weight operations whose influence on hidden states etrax traces."""

from ._conv import conv, conv_p, default_dimension_numbers
from ._einsum import EinsumSpec, einsum, einsum_p, parse_einsum
from ._elementwise import element_wise, element_wise_p
from ._embedding import embedding, embedding_p
from ._grouped import grouped_matmul, grouped_matmul_p
from ._lora import lora_matmul, lora_matmul_p
from ._matmul import matmul, matmul_p
from ._primitive import (
    ETPOpSpec,
    ETPRules,
    Factorization,
    bind,
    etp_spec,
    is_etp_primitive,
    register_primitive,
    register_rules,
    registered_primitives,
)
from ._sparse import SparsePattern, sparse_matmul, sparse_matmul_p

__all__ = [
    "ETPOpSpec",
    "ETPRules",
    "EinsumSpec",
    "Factorization",
    "SparsePattern",
    "bind",
    "conv",
    "conv_p",
    "default_dimension_numbers",
    "einsum",
    "einsum_p",
    "element_wise",
    "element_wise_p",
    "embedding",
    "embedding_p",
    "etp_spec",
    "grouped_matmul",
    "grouped_matmul_p",
    "is_etp_primitive",
    "lora_matmul",
    "lora_matmul_p",
    "matmul",
    "matmul_p",
    "parse_einsum",
    "register_primitive",
    "register_rules",
    "registered_primitives",
    "sparse_matmul",
    "sparse_matmul_p",
]
