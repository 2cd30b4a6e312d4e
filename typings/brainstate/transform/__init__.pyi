# Stub for brainstate.transform: covers only the surface etrax uses.

from ._make_jaxpr import StatefulFunction as StatefulFunction
