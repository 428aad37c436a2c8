#!/usr/bin/env bash
# Creates .venv and installs gwenlake_hpc with its test extras. Safe to run again.
# `pip install torch==2.13.0` first: on our machines it takes the CPU build that lies on disk; an unpinned
# torch would pull a multi-GB CUDA build. On a GPU cluster, install the torch build that matches its CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q -e '.[test]' 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import gwenlake_hpc, torch; print('gwenlake_hpc', gwenlake_hpc.__version__, 'torch', torch.__version__)"
