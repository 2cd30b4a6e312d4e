# Stub for scikit-learn: covers only the surface etrax's examples and demo use.
