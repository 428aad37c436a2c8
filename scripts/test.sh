#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), then the whole test suite against real services
# (real git, real `mlflow server` processes started by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian packages of the real-service tests: git-lfs (model weights), openssh-server (submission over SSH).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v git-lfs >/dev/null || missing+=(git-lfs)
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v pgrep >/dev/null || missing+=(procps)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}"
    (apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; }) ||
      echo "could not install ${missing[*]}: the tests that need them will be skipped"
  fi
fi
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
exec .venv/bin/python -m pytest -q --durations=25 "$@"
