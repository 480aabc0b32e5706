#!/usr/bin/env bash
# A throw-away SLURM cluster on this host, for the tests and for trying SLURM mode: munge on a private socket,
# slurmctld and 5 slurmd (n1..n5, `slurmd -N nX`, ports 17001-17005, all on 127.0.0.1). n4 and n5 are held by
# the reservation `standby`. Everything (config, state, logs, sockets, pid files) lives in one directory.
#
#   slurm/local-cluster.sh up DIR [--hooks PYTHON] [--multihost]   # bring it up; prints `export SLURM_CONF=...`
#   slurm/local-cluster.sh down DIR                  # stop everything it started, by PID (idempotent)
#
# --hooks PYTHON installs slurm/hooks.py as Prolog/Epilog (PrologFlags=Alloc) with that interpreter and with
# TM_STATE_DIR (if set) baked in. --multihost emulates separate hosts: each slurmd runs in a network namespace of
# its own, with its own address on a Linux bridge (`python -m tmd.netns hold`, run with $TM_PYTHON or python3, holds
# them: tmbr<k>, n<i> at 10.214.<k>.<i+1>, interface tm0), and slurmctld listens on the bridge's address
# 10.214.<k>.1, so nothing passes over 127.0.0.1: a job's processes (tmd in the batch script, the ranks srun starts,
# the prolog and epilog) live in their node's namespace; clients in the host namespace reach slurmctld and tmd
# through the bridge. DIR/etc/netns.env lists the namespaces (NETNS_n<i>) and addresses (ADDR_n<i>).
# Needs root (slurmd runs as root) and the Debian packages `slurmctld slurmd slurm-client munge`. Env:
# TM_SLURM_CTLD_PORT (default 16817), TM_SLURM_NODES (default 5), TM_SLURM_UP_TIMEOUT_S (default 60).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CMD=${1:-}
DIR=${2:-}
[ -n "$CMD" ] && [ -n "$DIR" ] || { echo "usage: $0 up|down DIR [--hooks PYTHON] [--multihost]" >&2; exit 2; }
NODES=${TM_SLURM_NODES:-5}
CTLD_PORT=${TM_SLURM_CTLD_PORT:-16817}
UP_TIMEOUT_S=${TM_SLURM_UP_TIMEOUT_S:-60}

die() { echo "local-cluster: error: $*" >&2; exit 1; }

pid_if() {  # pid_if FILE NAME: the pid in FILE if that process is alive and is NAME
    local pid
    pid=$(cat "$1" 2>/dev/null || true)
    if [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]; then echo "$pid"; fi
}

stop_pids() {  # stop_pids PID...: SIGTERM all at once, SIGKILL what is left after 5 s
    local pid i left
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    for i in $(seq 50); do
        left=""
        for pid in "$@"; do [ -d "/proc/$pid" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ] && left="$left $pid"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    # shellcheck disable=SC2086
    for pid in $left; do echo "local-cluster: SIGKILL $pid $(cat /proc/$pid/comm 2>/dev/null)" >&2; done; kill -KILL $left 2>/dev/null || true
}

down() {
    [ -d "$DIR" ] || return 0
    # Jobs first, while the daemons still run: their steps' processes are children of slurmstepd.
    if [ -f "$DIR/etc/env.sh" ] && command -v scancel >/dev/null; then
        SLURM_CONF="$DIR/etc/slurm.conf" timeout 5 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        local i
        for i in $(seq 50); do  # until the jobs (epilogs included) are done: slurmd stops slowly in the middle
            [ -z "$(SLURM_CONF="$DIR/etc/slurm.conf" timeout 2 squeue --noheader --format=%i 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
    local f pid pids=""
    for f in "$DIR"/run/slurmd.*.pid; do [ -e "$f" ] && pids="$pids $(pid_if "$f" slurmd)"; done
    pids="$pids $(pid_if "$DIR/run/slurmctld.pid" slurmctld)"
    # What outlives slurmd: slurmstepd, job processes, srun clients. All carry this cluster's SLURM_CONF in their
    # environment; of those, stop slurmstepd/srun and whatever runs in a job (SLURM_JOB_ID), never a mere client.
    for f in $(grep -lzx "SLURM_CONF=$DIR/etc/slurm.conf" /proc/[0-9]*/environ 2>/dev/null || true); do
        pid=${f#/proc/}; pid=${pid%/environ}
        [ "$pid" = $$ ] && continue
        case $(cat "/proc/$pid/comm" 2>/dev/null) in
            slurmstepd|srun) pids="$pids $pid" ;;
            *) grep -qz "^SLURM_JOB_ID=" "$f" 2>/dev/null && pids="$pids $pid" ;;
        esac
    done
    # shellcheck disable=SC2086
    stop_pids $pids
    stop_pids $(pid_if "$DIR/munge-run/munged.pid" munged)
    # --multihost: the namespaces' holder deletes them and the bridge on SIGTERM (nothing runs in them any more)
    pid=$(cat "$DIR/run/netns.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && grep -qz "^tmd.netns$" "/proc/$pid/cmdline" 2>/dev/null; then stop_pids "$pid"; fi
    rm -f "$DIR"/run/*.pid "$DIR/munge-run/munged.pid" "$DIR/etc/env.sh" "$DIR/etc/netns.env"
}

hold_namespaces() {  # hold_namespaces NODE...: one network namespace per node on a bridge (--multihost)
    local py=${TM_PYTHON:-python3} deadline=$((SECONDS + 30))
    rm -f "$DIR/etc/netns.env"
    # In the background, its output to a file (a caller reading ours must not wait on it), until `down`.
    (cd "$HERE/.." && exec "$py" -m tmd.netns hold --env "$DIR/etc/netns.env" "$@" </dev/null \
        >"$DIR/log/netns.log" 2>&1) &
    echo $! > "$DIR/run/netns.pid"
    until [ -f "$DIR/etc/netns.env" ]; do
        kill -0 "$(cat "$DIR/run/netns.pid")" 2>/dev/null || die "no network namespaces: $(tail -n 1 "$DIR/log/netns.log")"
        [ $SECONDS -lt $deadline ] || die "the network namespaces took over 30 s (see $DIR/log/netns.log)"
        sleep 0.1
    done
    # shellcheck disable=SC1091
    . "$DIR/etc/netns.env"
}

up() {
    local hooks_python="" multihost=""
    shift 2
    while [ $# -gt 0 ]; do
        case $1 in
            --hooks) hooks_python=$2; shift 2 ;;
            --multihost) multihost=1; shift ;;
            *) die "unknown option $1" ;;
        esac
    done
    [ "$(id -u)" = 0 ] || die "needs root (slurmd runs as root)"
    local b
    for b in munged mungekey slurmctld slurmd scontrol sinfo ${multihost:+ip nsenter}; do
        command -v "$b" >/dev/null || die "$b not found: install the Debian packages slurmctld slurmd slurm-client munge"
    done
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    [ -f "$DIR/run/slurmctld.pid" ] && die "$DIR already has a cluster; run '$0 down $DIR' first"
    # munged insists on: a private key dir, a socket dir everyone can traverse.
    chmod 755 "$DIR"
    mkdir -p "$DIR/munge" "$DIR/munge-run" "$DIR/etc" "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run" "$DIR/hooks"
    chmod 700 "$DIR/munge"; chmod 755 "$DIR/munge-run" "$DIR/etc"
    [ -f "$DIR/munge/munge.key" ] || mungekey --create --keyfile="$DIR/munge/munge.key" >/dev/null
    local sock="$DIR/munge-run/munge.socket"
    munged --socket="$sock" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge-run/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || die "munged did not start (see $DIR/munge/munged.log)"

    local host; host=$(hostname -s)
    local user; user=$(id -un)
    local i ctld_addr=127.0.0.1 node_conf
    node_conf="NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODES))] CPUs=2 RealMemory=1024 State=UNKNOWN"
    if [ -n "$multihost" ]; then
        hold_namespaces $(for i in $(seq "$NODES"); do echo "n$i"; done)
        ctld_addr=$NETNS_HOST_IP
        node_conf=$(for i in $(seq "$NODES"); do
            a="ADDR_n$i"
            echo "NodeName=n$i NodeHostname=$host NodeAddr=${!a} Port=$((17000 + i)) CPUs=2 RealMemory=1024 State=UNKNOWN"
        done)
    fi
    local hooks_conf=""
    if [ -n "$hooks_python" ]; then
        # a 3 s budget, not the hooks' 0.8 s: here 5 emulated nodes, their daemons and a training job share 2 cores,
        # and a hook's interpreter start-up alone took over 0.8 s in a CI run
        "$HERE/install-hooks.sh" --python "$hooks_python" --dest "$DIR/hooks" --log "$DIR/log/hooks.log" \
            ${TM_STATE_DIR:+--state-dir "$TM_STATE_DIR"} -- --budget-s 3 >/dev/null
        hooks_conf="Prolog=$DIR/hooks/prolog
Epilog=$DIR/hooks/epilog
PrologFlags=Alloc"
    fi
    cat > "$DIR/etc/slurm.conf" <<EOF
# Generated by slurm/local-cluster.sh: a throw-away cluster, all nodes on this host${multihost:+, each in a network namespace of its own}.
ClusterName=tmlocal
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdTimeout=10
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
MessageTimeout=10
SchedulerParameters=permit_job_expansion
SlurmdParameters=config_overrides
$hooks_conf
$node_conf
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
    cat > "$DIR/etc/env.sh" <<EOF
export SLURM_CONF=$DIR/etc/slurm.conf
EOF
    export SLURM_CONF="$DIR/etc/slurm.conf"
    (cd "$DIR/spool" && slurmctld -f "$SLURM_CONF" -i) || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
    local ns netns_exec
    for i in $(seq "$NODES"); do
        mkdir -p "$DIR/spool/n$i"
        netns_exec=()
        # only the network namespace: `ip netns exec` would also remount /sys, without the cgroup fs slurmd needs
        if [ -n "$multihost" ]; then ns="NETNS_n$i"; netns_exec=(nsenter "--net=/var/run/netns/${!ns}"); fi
        (cd "$DIR/spool" && "${netns_exec[@]}" slurmd -f "$SLURM_CONF" -N "n$i") \
            || die "slurmd n$i did not start (see $DIR/log/slurmd.n$i.log)"
    done
    # Wait (bounded) until every node is idle, then hold the last two in the standby reservation.
    local deadline=$((SECONDS + UP_TIMEOUT_S)) idle
    while :; do
        idle=$(timeout 5 sinfo --noheader --Node --states=idle --format=%N 2>/dev/null | sort -u | wc -l || true)
        [ "$idle" -ge "$NODES" ] && break
        [ $SECONDS -lt $deadline ] || die "only $idle of $NODES nodes idle after ${UP_TIMEOUT_S} s (see $DIR/log)"
        sleep 0.2
    done
    timeout 10 scontrol create reservation ReservationName=standby Nodes="n$((NODES - 1)),n$NODES" \
        StartTime=now Duration=infinite Users="$user" >/dev/null || die "could not create the standby reservation"
    echo "export SLURM_CONF=$SLURM_CONF"
}

case $CMD in
    up) up "$@" ;;
    down) down ;;
    *) echo "usage: $0 up|down DIR [--hooks PYTHON] [--multihost]" >&2; exit 2 ;;
esac
