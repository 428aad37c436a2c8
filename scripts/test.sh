#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), then the whole test suite against real services
# (real git, real `mlflow server` processes started by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The local SLURM cluster (needs root and Debian's packages); without it the cluster tests are skipped.
if ! sinfo >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    bash scripts/slurm-cluster.sh up || echo "no SLURM cluster could be started: its tests will be skipped"
  else
    echo "not root: no local SLURM cluster started, its tests will be skipped"
  fi
fi
# One thread per process: two cores are shared by the tests' subprocesses.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q "$@"
