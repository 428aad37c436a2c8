#!/usr/bin/env bash
# Creates .venv and installs gwenlake_hpc with its test, examples and docs extras. Safe to run again.
# `pip install torch==2.13.0` first: on our machines it takes the CPU build that lies on disk; an unpinned
# torch would pull a multi-GB CUDA build. On a GPU cluster, install the torch build that matches its CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# pip's output goes to a log, shown only when an install fails.
pip_install() {
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2; rm -f "$log"; echo "pip install $* failed" >&2; exit 1
  fi
  rm -f "$log"
}
pip_install "torch==${TORCH_VERSION:-2.13.0}"
pip_install -e '.[test,examples,docs]'
.venv/bin/python -c "import gwenlake_hpc, torch; print('gwenlake_hpc', gwenlake_hpc.__version__, 'torch', torch.__version__)"
