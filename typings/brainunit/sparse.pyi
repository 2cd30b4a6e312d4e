# Stub for brainunit.sparse: covers only the surface etrax's tests use.

from typing import Any

class CSR:
    @classmethod
    def fromdense(cls, mat: Any, *, nse: int | None = None, index_dtype: Any = ...) -> CSR: ...
