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
# The whole suite in three streams at once (two cores): the tests on the SLURM cluster (-m slurm: the cluster,
# submission over SSH) spend most of their time waiting on SLURM (steps that sleep, preemption, requeue delays)
# and must run one at a time (a preemption test's job would preempt another's); the tests marked waits (servers
# down, sleeps, network filesystems) and the rest are shared by two streams, by file name (integration tests
# test_a* to test_h* and the HF Trainer's with the unit tier; Lightning's and test_j* to test_z* in the other:
# about the same time each, measured). Each stream has its own temporary
# folder; the outputs are printed in turn. GWENLAKE_TEST_SERIAL=1 runs one pytest instead.
tmp=$(mktemp -d /tmp/gwenlake-tests.XXXXXX)
pytest() { .venv/bin/python -m pytest -q -p no:cacheprovider "$@"; }
( pytest --durations=15 -m slurm --basetemp="$tmp/cluster" tests ) > "$tmp/cluster.log" 2>&1 &
cluster_pid=$!
( w=0 a=0
  pytest --durations=10 -m "waits and not slurm" --basetemp="$tmp/waits" tests || w=$?
  pytest --durations=15 -m "not slurm and not waits" --basetemp="$tmp/a" tests/unit tests/integration/test_[a-h]*.py \
    tests/integration/test_integrations_hf.py || a=$?
  [ "$w" = 5 ] && w=0
  exit $(( w != 0 ? w : a ))
) > "$tmp/a.log" 2>&1 &
a_pid=$!
set +e
pytest --durations=20 -m "not slurm and not waits" --basetemp="$tmp/b" tests/integration/test_integrations_[!h]*.py \
  tests/integration/test_[j-z]*.py tests/cluster
b_rc=$?
wait "$a_pid"
a_rc=$?
wait "$cluster_pid"
cluster_rc=$?
set -e
echo "=== the tests marked waits, then the unit tier and integration tests test_a* to test_h* and HF's, run at the same time ==="
cat "$tmp/a.log"
echo "=== tests on the SLURM cluster (-m slurm), run at the same time ==="
cat "$tmp/cluster.log"
echo "exit statuses: integration Lightning and j-z $b_rc, waits+unit+integration a-h and HF $a_rc, slurm $cluster_rc"
rm -rf "$tmp"
# pytest's 5 (nothing collected) is not a failure for a stream that is empty here.
for rc in "$b_rc" "$a_rc" "$cluster_rc"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
exit 0
