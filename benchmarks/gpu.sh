#!/usr/bin/env bash
# The side-by-side benchmark against braintrace 0.2.6 on a GPU machine that has jax
# (with CUDA), equinox, jaxtyping, optax, matplotlib and numpy but none of the brain*
# packages: run from the repository root with the wheels in .whl/ (see docs/benchmarks.md
# for how to fill it) and the output folder in $OUT; further arguments go to `run.py peer`
# (e.g. `--only GRU:1:512:32 LIF:1:512:32`). About 8 minutes on one H200.
set -euo pipefail
OUT="${OUT:-benchmarks/results}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import jax, brainstate, braintrace; print('jax', jax.__version__, jax.devices(), \
'brainstate', brainstate.__version__, 'braintrace', braintrace.__version__)"
# no new configuration is started after 360 s, so the run ends within about 8 minutes
python3 benchmarks/run.py peer --matrix gpu --budget "${BUDGET:-360}" --out "$OUT" "$@"
