#!/usr/bin/env bash
# A real SLURM 22.05 cluster on localhost for integration tests: munge, slurmdbd on MariaDB,
# slurmctld and two slurmd (nodes n1, n2, 2 CPUs and 2 fake GPUs each) on one machine.
#
#   bash scripts/slurm-cluster.sh up      # install (apt) if needed, configure, start, verify; idempotent
#   bash scripts/slurm-cluster.sh down    # stop slurmd n1/n2, slurmctld, slurmdbd (munged and MariaDB stay)
#   bash scripts/slurm-cluster.sh status  # sinfo + accounting connectivity
#
# Runs as root, without systemd (daemons are started directly and tracked by pid files). Each slurmd runs in a
# mount namespace of its own (unshare -m, where allowed), so a test can mount a folder differently on each node
# (tests/helpers/sshfs.py node_mounts: the runs root through one sshfs mount per node, as on a real cluster).
# Partitions: low (default, PriorityTier=1) and high (PriorityTier=10); a high job preempts low jobs,
# which are requeued (PreemptMode=REQUEUE). Requeued jobs carry a ~2 min BeginTime: as root,
# `scontrol update jobid=N StartTime=now` lets them start again at once.
set -euo pipefail

CLUSTER=gwenlake
ACCOUNT=gwenlake
NODES=(n1 n2)
declare -A NODE_PORT=([n1]=17001 [n2]=17002)
ETC=/etc/slurm
RUN=/run/slurm
LOG=/var/log/slurm
GPU_DIR=/var/lib/slurm-fake-gpu
CTLD_PID=$RUN/slurmctld.pid
DBD_PID=$RUN/slurmdbd.pid
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge runc)

say() { printf '%s\n' "$*"; }
ok() { printf '  ok    %s\n' "$*"; }
die() { printf 'slurm-cluster: %s\n' "$*" >&2; exit 1; }

logs_tail() {  # the last lines of every daemon log, to stderr
    local f
    for f in "$LOG/slurmdbd.log" "$LOG/slurmctld.log" "$LOG"/slurmd-n1.log "$LOG"/slurmd-n2.log ; do
        [ -f "$f" ] || continue
        printf '\n----- tail %s -----\n' "$f" >&2
        tail -n 25 "$f" >&2 || true
    done
}

fail() { printf '  FAIL  %s\n' "$*" >&2; logs_tail; exit 1; }

need_root() { [ "$(id -u)" -eq 0 ] || die "run as root (sudo bash $0 $*)"; }

# ---------------------------------------------------------------- processes
pid_alive() {  # pid_alive PIDFILE NAME: the pid file names a live process called NAME
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: SIGTERM, then SIGKILL after 20 s
    local pid i
    if ! pid_alive "$1" "$2"; then rm -f "$1"; return 0; fi
    pid=$(cat "$1")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.5; fi
    rm -f "$1"
    say "  stopped $2 (pid $pid)"
}

wait_for() {  # wait_for SECONDS COMMAND...: poll COMMAND every 0.5 s until it succeeds; 1 on time-out
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.5
    done
}

# ---------------------------------------------------------------- packages
install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ! -x /usr/sbin/mariadbd ] && [ ! -x /usr/sbin/mysqld ]; then missing+=(mariadb-server); fi
    if [ "${#missing[@]}" -gt 0 ]; then
        say "installing ${missing[*]} (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    fi
    ok "packages (slurm $(slurmctld -V | awk '{print $2}'))"
}

# ---------------------------------------------------------------- munge
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    if [ ! -s /etc/munge/munge.key ]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    if ! munge_ok; then
        # A stale socket/pid from a killed munged makes it refuse to start; --force takes them over.
        runuser -u munge -- /usr/sbin/munged --force
        wait_for 15 munge_ok || fail "munged does not answer (munge -n | unmunge)"
    fi
    ok "munge (munge -n | unmunge)"
}

# ---------------------------------------------------------------- MariaDB
mysql_root() { mariadb --protocol=socket -uroot; }  # SQL on stdin
mysql_ok() { timeout 10 mariadb --protocol=socket -uroot -e 'SELECT 1' >/dev/null 2>&1; }

start_mariadb() {
    if ! mysql_ok; then
        install -d -o mysql -g mysql -m 0755 /run/mysqld
        [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- --user=mysql
        wait_for 60 mysql_ok || { tail -n 20 /var/log/mysql/error.log >&2 2>/dev/null || true; fail "MariaDB does not answer"; }
    fi
    ok "mariadb"
}

# ---------------------------------------------------------------- configuration
dbd_password() {  # the StoragePass already in slurmdbd.conf, or a new random one
    local pw=""
    [ -f "$ETC/slurmdbd.conf" ] && pw=$(sed -n 's/^StoragePass=//p' "$ETC/slurmdbd.conf" | head -n 1)
    [ -n "$pw" ] || pw=$(od -An -tx1 -N18 /dev/urandom | tr -d ' \n')
    printf '%s' "$pw"
}

write_slurmdbd_conf() {  # $1 = target file (mode 0600)
    local pw
    pw=$(dbd_password)
    cat >"$1" <<EOF
# Written by scripts/slurm-cluster.sh (test cluster). Holds the database password: mode 0600, owner slurm.
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
LogFile=$LOG/slurmdbd.log
PidFile=$DBD_PID
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$pw
StorageLoc=slurm_acct_db
EOF
}

write_slurm_conf() {  # $1 = target file
    cat >"$1" <<EOF
# Written by scripts/slurm-cluster.sh: a test cluster, two nodes (two slurmd) on this one machine.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort=6817
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none
# No cgroups here. pgid, not linuxproc: linuxproc loses the children of a batch shell that a SIGTERM killed
# first (they are reparented) and never SIGKILLs them; pgid kills the job's whole process group.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd-%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
# Use the node sizes below, whatever this machine has: both nodes share its cores.
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=10
MinJobAge=120
InactiveLimit=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
GresTypes=gpu
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=${NODE_PORT[n1]} CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=${NODE_PORT[n2]} CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=low Nodes=n1,n2 Default=YES PriorityTier=1 MaxTime=INFINITE State=UP
PartitionName=high Nodes=n1,n2 Default=NO PriorityTier=10 MaxTime=INFINITE State=UP
EOF
}

write_gres_conf() {  # $1 = target file
    {
        echo "# Written by scripts/slurm-cluster.sh: fake GPUs for the test cluster (char devices 1:3, or plain files)."
        local n
        for n in "${NODES[@]}"; do echo "NodeName=$n Name=gpu File=$GPU_DIR/$n/gpu[0-1]"; done
    } >"$1"
}

write_oci_conf() {  # $1 = target file
    # srun --container=BUNDLE runs the step in runc (a Debian package; crun 1.8 refuses hybrid cgroups); container ids carry the node name, as
    # both nodes share this machine.
    cat >"$1" <<'EOF'
# Written by scripts/slurm-cluster.sh: srun --container=BUNDLE runs the step in runc.
RunTimeQuery="runc --root=/run/slurm-oci state %n.%u.%j.%s.%t"
RunTimeKill="runc --root=/run/slurm-oci kill -a %n.%u.%j.%s.%t"
RunTimeDelete="runc --root=/run/slurm-oci delete --force %n.%u.%j.%s.%t"
RunTimeRun="runc --root=/run/slurm-oci run %n.%u.%j.%s.%t -b %b"
EOF
}

# install_conf WRITER TARGET MODE OWNER: writes the file only if its content changes; returns 0 when it changed
install_conf() {
    local tmp changed=1
    tmp=$(mktemp)
    "$1" "$tmp"
    if [ ! -f "$2" ] || ! cmp -s "$tmp" "$2"; then
        install -m "$3" -o "${4%:*}" -g "${4#*:}" "$tmp" "$2"
        changed=0
    else
        chmod "$3" "$2"; chown "$4" "$2"
    fi
    rm -f "$tmp"
    return $changed
}

configs_current() {  # all three config files already hold what this script writes
    local tmp w f rc=0
    tmp=$(mktemp)
    for w in write_slurm_conf:slurm.conf write_gres_conf:gres.conf write_slurmdbd_conf:slurmdbd.conf write_oci_conf:oci.conf; do
        f=$ETC/${w#*:}
        [ -f "$f" ] || { rc=1; break; }
        "${w%%:*}" "$tmp"
        cmp -s "$tmp" "$f" || { rc=1; break; }
    done
    rm -f "$tmp"
    return $rc
}

gpu_files_current() {  # the fake GPUs are character devices (where mknod is not allowed: never current)
    local n
    for n in "${NODES[@]}"; do [ -c "$GPU_DIR/$n/gpu0" ] && [ -c "$GPU_DIR/$n/gpu1" ] || return 1; done
}

# A daemon whose pid file (written when it started) is older than one of its config files, restarts.
SLURM_FILES=("$ETC/slurm.conf" "$ETC/gres.conf" "$ETC/oci.conf")
for _n in "${NODES[@]}"; do SLURM_FILES+=("$GPU_DIR/$_n/gpu0" "$GPU_DIR/$_n/gpu1"); done
started_before() {  # started_before PIDFILE FILE...: one of the files changed after the daemon started
    local f
    for f in "${@:2}"; do [ "$f" -nt "$1" ] && return 0; done
    return 1
}

daemons_current() {
    local n
    started_before "$DBD_PID" "$ETC/slurmdbd.conf" && return 1
    started_before "$CTLD_PID" "${SLURM_FILES[@]}" && return 1
    for n in "${NODES[@]}"; do started_before "$RUN/slurmd-$n.pid" "${SLURM_FILES[@]}" && return 1; done
    return 0
}

write_configs() {
    install -d -m 0755 "$ETC"
    install -d -o slurm -g slurm -m 0755 "$RUN" "$LOG"
    install -d -m 0755 /var/spool/slurmctld
    local n f
    for n in "${NODES[@]}"; do
        install -d -m 0755 "/var/spool/slurmd-$n" "$GPU_DIR/$n"
        # Fake GPU devices: character devices 1:3 (what /dev/null is) where mknod is allowed, so that
        # slurmd accepts them and sets CUDA_VISIBLE_DEVICES; else ordinary files (slurmd logs an error
        # but still hands them out: jobs see SLURM_GPUS_ON_NODE, without CUDA_VISIBLE_DEVICES).
        for f in "$GPU_DIR/$n/gpu0" "$GPU_DIR/$n/gpu1"; do
            [ -c "$f" ] && continue
            rm -f "$f"
            mknod -m 0666 "$f" c 1 3 2>/dev/null || touch "$f"
        done
    done
    install_conf write_slurm_conf "$ETC/slurm.conf" 0644 root:root || true
    install_conf write_gres_conf "$ETC/gres.conf" 0644 root:root || true
    install_conf write_oci_conf "$ETC/oci.conf" 0644 root:root || true
    install_conf write_slurmdbd_conf "$ETC/slurmdbd.conf" 0600 slurm:slurm || true
    # Node names resolve to this machine (MASTER_ADDR for torch.distributed is a node name).
    for n in "${NODES[@]}"; do
        grep -Eq "^[[:space:]]*127\.0\.0\.1([[:space:]].*)?[[:space:]]$n([[:space:]]|\$)" /etc/hosts ||
            echo "127.0.0.1 $n" >>/etc/hosts
    done
    ok "config $ETC/slurm.conf, gres.conf, slurmdbd.conf (0600 slurm); /etc/hosts has ${NODES[*]}"
}

# ---------------------------------------------------------------- accounting
dbd_ok() { timeout 10 sacctmgr -n -P show cluster format=cluster </dev/null >/dev/null 2>&1; }

setup_database() {
    local pw
    pw=$(sed -n 's/^StoragePass=//p' "$ETC/slurmdbd.conf" | head -n 1)
    [ -n "$pw" ] || fail "no StoragePass in $ETC/slurmdbd.conf"
    # The password goes on stdin, never on a command line or in the output.
    mysql_root <<EOF || fail "cannot create the slurm_acct_db database / slurm user in MariaDB"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pw';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
    ok "database slurm_acct_db, user slurm@localhost"
}

start_slurmdbd() {
    if pid_alive "$DBD_PID" slurmdbd && started_before "$DBD_PID" "$ETC/slurmdbd.conf"; then
        say "  slurmdbd.conf changed: restarting slurmdbd"
        stop_pidfile "$DBD_PID" slurmdbd
    fi
    if ! pid_alive "$DBD_PID" slurmdbd; then
        /usr/sbin/slurmdbd || fail "slurmdbd does not start"
    fi
    # The first start creates the tables: give it time.
    wait_for 90 dbd_ok || fail "slurmdbd does not answer (sacctmgr show cluster)"
    ok "slurmdbd (pid $(cat "$DBD_PID" 2>/dev/null))"
}

# sacctmgr asks questions on stdin (even "show" with odd options): always give it /dev/null.
sacctmgr_q() { timeout 30 sacctmgr "$@" </dev/null; }

sacctmgr_has() {  # sacctmgr_has cluster|account|user NAME
    case "$1" in
        cluster) sacctmgr_q -n -P show cluster format=cluster 2>/dev/null | grep -qx "$2" ;;
        account) sacctmgr_q -n -P show assoc where cluster="$CLUSTER" account="$2" format=account 2>/dev/null | grep -qx "$2" ;;
        user) sacctmgr_q -n -P show assoc where cluster="$CLUSTER" account="$ACCOUNT" user="$2" format=user 2>/dev/null | grep -qx "$2" ;;
    esac
}

setup_associations() {
    sacctmgr_has cluster "$CLUSTER" || sacctmgr_q -i add cluster "$CLUSTER" >/dev/null ||
        fail "sacctmgr add cluster $CLUSTER"
    sacctmgr_has account "$ACCOUNT" || sacctmgr_q -i add account "$ACCOUNT" cluster="$CLUSTER" \
        description=tests organization=gwenlake >/dev/null || fail "sacctmgr add account $ACCOUNT"
    local users=(root) u
    if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then users+=("$SUDO_USER"); fi
    for u in "${users[@]}"; do
        sacctmgr_has user "$u" || sacctmgr_q -i add user "$u" account="$ACCOUNT" cluster="$CLUSTER" >/dev/null ||
            fail "sacctmgr add user $u"
        # root starts with default account "root": its jobs are charged to gwenlake instead.
        [ "$(sacctmgr_q -n -P show user "$u" format=defaultaccount 2>/dev/null)" = "$ACCOUNT" ] ||
            sacctmgr_q -i modify user where name="$u" set defaultaccount="$ACCOUNT" >/dev/null ||
            fail "sacctmgr modify user $u set defaultaccount=$ACCOUNT"
    done
    ok "accounting: cluster $CLUSTER, account $ACCOUNT, users ${users[*]}"
}

# ---------------------------------------------------------------- controller and nodes
ctld_ok() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }

node_states() { timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

nodes_up() {  # every node is idle, mixed, allocated or completing
    local states n
    states=$(node_states) || return 1
    for n in "${NODES[@]}"; do
        grep -Eq "^$n (idle|mix|alloc|comp)\$" <<<"$states" || return 1
    done
}

start_slurmctld() {
    local n restart=0
    pid_alive "$CTLD_PID" slurmctld && started_before "$CTLD_PID" "${SLURM_FILES[@]}" && restart=1
    for n in "${NODES[@]}"; do
        pid_alive "$RUN/slurmd-$n.pid" slurmd && started_before "$RUN/slurmd-$n.pid" "${SLURM_FILES[@]}" && restart=1
    done
    if [ $restart = 1 ]; then
        # Node definitions and GRES are read at start: restart all (running jobs survive in slurmstepd).
        say "  slurm.conf/gres.conf changed: restarting slurmctld and slurmd"
        for n in "${NODES[@]}"; do stop_pidfile "$RUN/slurmd-$n.pid" slurmd; done
        stop_pidfile "$CTLD_PID" slurmctld
    fi
    if ! pid_alive "$CTLD_PID" slurmctld; then
        /usr/sbin/slurmctld || fail "slurmctld does not start"
    fi
    wait_for 60 ctld_ok || fail "slurmctld does not answer (scontrol ping)"
    ok "slurmctld (pid $(cat "$CTLD_PID" 2>/dev/null))"
}

own_mounts() {  # run "$@" in a mount namespace of its own where unshare may make one, else as it is
    if command -v unshare >/dev/null && unshare -m true 2>/dev/null; then
        unshare -m --propagation slave "$@"
    else
        "$@"
    fi
}

start_slurmds() {
    local n
    for n in "${NODES[@]}"; do
        pid_alive "$RUN/slurmd-$n.pid" slurmd || own_mounts /usr/sbin/slurmd -N "$n" || fail "slurmd -N $n does not start"
    done
    local deadline=$((SECONDS + 90)) resumed=0 states
    until nodes_up; do
        [ "$SECONDS" -lt "$deadline" ] || { node_states >&2 || true; fail "nodes ${NODES[*]} not up in sinfo"; }
        states=$(node_states || true)
        # A node left down/drained (e.g. killed slurmd, earlier config) comes back with state=resume.
        if [ $resumed -lt 3 ] && grep -Eq ' (down|drain|drng|drained|fail)' <<<"$states"; then
            timeout 10 scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume >/dev/null 2>&1 || true
            resumed=$((resumed + 1))
        fi
        sleep 1
    done
    ok "slurmd ${NODES[*]}: $(node_states | tr '\n' ' ')"
}

# ---------------------------------------------------------------- verification
sacct_state() { sacct -n -P -X -j "$1" -o State 2>/dev/null | head -n 1; }

wait_job() {  # wait_job ID SECONDS: until sacct shows a final state; prints it
    local deadline=$((SECONDS + $2)) s=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        s=$(sacct_state "$1")
        case "$s" in COMPLETED* | FAILED* | CANCELLED* | TIMEOUT* | NODE_FAIL* | OUT_OF_MEMORY* | BOOT_FAIL* | DEADLINE*)
            printf '%s' "$s"; return 0 ;;
        esac
        sleep 1
    done
    printf '%s' "${s:-unknown}"
    return 1
}

# shellcheck disable=SC2016  # job commands in single quotes expand in the job
verify() {
    local out id state tmp
    munge_ok || fail "munge -n | unmunge"
    ok "munge credential round trip"
    dbd_ok || fail "sacctmgr cannot reach slurmdbd"
    sacctmgr_has cluster "$CLUSTER" || fail "cluster $CLUSTER not in accounting"
    ok "slurmdbd answers, cluster $CLUSTER registered"
    nodes_up || fail "nodes not up: $(node_states | tr '\n' ' ')"
    tmp=$(mktemp -d)
    chmod 0755 "$tmp"
    out=$(timeout 120 srun -Q -N2 -n2 --time=2 -J verify-srun bash -c 'echo $SLURMD_NODENAME' 2>"$tmp/err" |
        sort | tr '\n' ' ') || fail "srun -N2: $out $(cat "$tmp/err")"
    [ "$out" = "n1 n2 " ] || fail "srun -N2 ran on: '$out' $(cat "$tmp/err")"
    ok "srun -N2 runs one task on each of n1, n2"
    id=$(sbatch --parsable -J verify-sbatch -o "$tmp/out" --time=2 --wrap 'echo sbatch-ok') ||
        fail "sbatch --wrap"
    id=${id%%;*}
    state=$(wait_job "$id" 90) || fail "sbatch job $id did not finish in 90 s (state $state)"
    [[ "$state" == COMPLETED* ]] || fail "sbatch job $id: sacct state $state"
    grep -q sbatch-ok "$tmp/out" || fail "sbatch job $id: no output"
    ok "sbatch --wrap job $id COMPLETED (sacct)"
    out=$(timeout 120 srun -Q -N1 -n1 --gres=gpu:1 --time=2 -J verify-gpu \
        bash -c 'echo "$SLURM_GPUS_ON_NODE/${CUDA_VISIBLE_DEVICES:-}"' 2>"$tmp/err") ||
        fail "srun --gres=gpu:1: $out $(cat "$tmp/err")"
    if [ -c "$GPU_DIR/n1/gpu0" ]; then
        [ "$out" = "1/0" ] || fail "srun --gres=gpu:1 sees SLURM_GPUS_ON_NODE/CUDA_VISIBLE_DEVICES = $out (want 1/0)"
        ok "--gres=gpu:1 job sees SLURM_GPUS_ON_NODE=1 CUDA_VISIBLE_DEVICES=0"
    else
        [ "${out%%/*}" = "1" ] || fail "srun --gres=gpu:1 sees SLURM_GPUS_ON_NODE = ${out%%/*} (want 1)"
        ok "--gres=gpu:1 job sees SLURM_GPUS_ON_NODE=1 (fake GPUs are plain files: no CUDA_VISIBLE_DEVICES)"
    fi
    rm -rf "$tmp"
}

# ---------------------------------------------------------------- commands
cluster_answers() { munge_ok && dbd_ok && ctld_ok && nodes_up; }

cmd_up() {
    need_root up
    local t0=$SECONDS
    if command -v slurmctld >/dev/null && command -v mariadb >/dev/null && configs_current && gpu_files_current &&
        daemons_current && cluster_answers; then
        say "cluster $CLUSTER already up: verifying"
    else
        say "bringing up SLURM cluster $CLUSTER on localhost"
        install_packages
        start_munge
        start_mariadb
        write_configs
        setup_database
        start_slurmdbd
        setup_associations
        start_slurmctld
        start_slurmds
    fi
    verify
    say "cluster $CLUSTER up ($((SECONDS - t0)) s): partitions low (default) and high, nodes ${NODES[*]}"
}

cmd_down() {
    need_root down
    local n
    for n in "${NODES[@]}"; do stop_pidfile "$RUN/slurmd-$n.pid" slurmd; done
    stop_pidfile "$CTLD_PID" slurmctld
    stop_pidfile "$DBD_PID" slurmdbd
    say "cluster $CLUSTER down (munged and MariaDB left running)"
}

cmd_status() {
    local rc=0
    if ctld_ok; then
        ok "slurmctld answers"
        timeout 5 sinfo -N -o '%N %P %t %C %G' || true
    else
        printf '  FAIL  slurmctld does not answer\n'; rc=1
    fi
    if dbd_ok; then
        ok "slurmdbd answers: $(timeout 10 sacct -n -X -a -S now-1days -o JobID 2>/dev/null | wc -l) jobs in sacct in the last day"
    else
        printf '  FAIL  slurmdbd does not answer\n'; rc=1
    fi
    nodes_up || { printf '  FAIL  nodes not all up\n'; rc=1; }
    return $rc
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
