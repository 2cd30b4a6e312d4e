# Stub for brainunit: covers only the surface etrax, its tests and docs use.

from typing import Any

from . import math as math
from . import sparse as sparse

class Unit:
    def __mul__(self, other: Any) -> Any: ...
    def __rmul__(self, other: Any) -> Any: ...
    def __truediv__(self, other: Any) -> Any: ...
    def __rtruediv__(self, other: Any) -> Any: ...

class Quantity:
    def __init__(self, mantissa: Any, unit: Unit = ..., dtype: Any = ...) -> None: ...
    @property
    def unit(self) -> Unit: ...
    @property
    def mantissa(self) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...

def get_unit(x: Any) -> Unit: ...
def get_mantissa(x: Any) -> Any: ...

UNITLESS: Unit
mV: Unit
ms: Unit
nS: Unit
pA: Unit
nA: Unit
ohm: Unit
siemens: Unit
volt: Unit
second: Unit
