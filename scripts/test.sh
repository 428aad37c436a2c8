#!/usr/bin/env bash
# The test command: set-up (scripts/setup.sh), then the whole test suite against real services
# (real git, real `mlflow server` processes started by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian packages of the real-service tests: git-lfs (model weights), openssh-server (submission over SSH), sshfs
# (a network filesystem for the runs root).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v git-lfs >/dev/null || missing+=(git-lfs)
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v pgrep >/dev/null || missing+=(procps)
  command -v sshfs >/dev/null || missing+=(sshfs)
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
if [ $# -gt 0 ] || [ "${GWENLAKE_TEST_SERIAL:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
# The whole suite in two halves at once: the tests on the SLURM cluster (-m slurm: the cluster, submission over
# SSH) spend most of their time waiting on SLURM (steps that sleep, preemption, requeue delays), and so do the
# tests marked waits (servers down, sleeps); the others keep the cores busy. Each half has its own temporary folder; both outputs are printed, the cluster's
# last. GWENLAKE_TEST_SERIAL=1 runs one pytest instead.
cluster_tmp=$(mktemp -d /tmp/gwenlake-cluster-tests.XXXXXX)
cluster_log="$cluster_tmp.log"
.venv/bin/python -m pytest -q --durations=15 -m "slurm or waits" -p no:cacheprovider --basetemp="$cluster_tmp/t" \
  > "$cluster_log" 2>&1 &
cluster_pid=$!
set +e
.venv/bin/python -m pytest -q --durations=25 -m "not slurm and not waits"
rest_rc=$?
wait "$cluster_pid"
cluster_rc=$?
set -e
echo "=== tests on the SLURM cluster and those that mostly wait (-m 'slurm or waits'), run at the same time ==="
cat "$cluster_log"
echo "exit statuses: not slurm $rest_rc, slurm $cluster_rc"
rm -rf "$cluster_tmp" "$cluster_log"
# pytest's 5 (nothing collected) is not a failure for a half that is empty here.
for rc in "$rest_rc" "$cluster_rc"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
exit 0
