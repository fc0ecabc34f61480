#!/usr/bin/env bash
# Local Slurm cluster on loopback for tests and demos: one munged, one
# slurmctld and several slurmd (one per simulated node, `slurmd -N <node>`),
# everything (config, munge key, sockets, spool, state, logs, pids) under the
# state dir; nothing is written to /etc. Installs slurm-wlm and munge via apt
# when the daemons are missing. With FLEETMEDIC_SLURM_ACCOUNTING=1 also a
# MariaDB server and slurmdbd, so that sacct works.
#
# Usage: deploy/slurm.sh {start|stop|status|env|reset|help}
# See `deploy/slurm.sh help` for the environment variables and
# docs/decisions/0004-local-slurm.md for the design.
set -euo pipefail

STATE_ROOT="${FLEETMEDIC_STATE:-$HOME/.cache/fleetmedic/run}"
FLEETMEDIC_SLURM_NODES="${FLEETMEDIC_SLURM_NODES:-4}"
FLEETMEDIC_SLURM_BENCH_NODES="${FLEETMEDIC_SLURM_BENCH_NODES:-0}"
FLEETMEDIC_SLURM_NODE_CPUS="${FLEETMEDIC_SLURM_NODE_CPUS:-4}"
FLEETMEDIC_SLURM_NODE_MEMORY="${FLEETMEDIC_SLURM_NODE_MEMORY:-16000}"
FLEETMEDIC_SLURM_NODE_GPUS="${FLEETMEDIC_SLURM_NODE_GPUS:-8}"
FLEETMEDIC_SLURM_PARTITION="${FLEETMEDIC_SLURM_PARTITION:-gpu}"
FLEETMEDIC_SLURM_CRED_EXPIRE="${FLEETMEDIC_SLURM_CRED_EXPIRE:-10}"
FLEETMEDIC_SLURM_MIN_JOB_AGE="${FLEETMEDIC_SLURM_MIN_JOB_AGE:-120}"
FLEETMEDIC_SLURM_START_TIMEOUT="${FLEETMEDIC_SLURM_START_TIMEOUT:-60}"
FLEETMEDIC_SLURM_STOP_TIMEOUT="${FLEETMEDIC_SLURM_STOP_TIMEOUT:-30}"
FLEETMEDIC_SLURM_ACCOUNTING="${FLEETMEDIC_SLURM_ACCOUNTING:-0}"
STOP_TIMEOUT="$FLEETMEDIC_SLURM_STOP_TIMEOUT"  # read by terminate (deploy/lib.sh)

STATE_DIR="$STATE_ROOT/slurm"
CONF="$STATE_DIR/slurm.conf"
GRES_CONF="$STATE_DIR/gres.conf"
PORTS_FILE="$STATE_DIR/ports"
MUNGE_DIR="$STATE_DIR/munge"          # key, pid, log, seed (0700)
MUNGE_KEY="$MUNGE_DIR/munge.key"
MUNGE_PID="$MUNGE_DIR/munged.pid"
MUNGE_LOG="$MUNGE_DIR/munged.log"
MUNGE_SEED="$MUNGE_DIR/munged.seed"
MUNGE_SOCK_FILE="$STATE_DIR/munge.socket.path"
LOG_DIR="$STATE_DIR/log"
RUN_DIR="$STATE_DIR/run"
SPOOL_DIR="$STATE_DIR/spool"
SAVE_DIR="$STATE_DIR/state"
CTLD_PID="$RUN_DIR/slurmctld.pid"
CTLD_LOG="$LOG_DIR/slurmctld.log"
# accounting (FLEETMEDIC_SLURM_ACCOUNTING=1): MariaDB's data, slurmdbd.conf
# (slurmdbd reads it from the directory of SLURM_CONF), the database password
DB_DIR="$STATE_DIR/db"
DB_PID="$RUN_DIR/mariadbd.pid"
DB_LOG="$LOG_DIR/mariadbd.log"
DB_PASS_FILE="$STATE_DIR/db.pass"
DBD_CONF="$STATE_DIR/slurmdbd.conf"
DBD_PID="$RUN_DIR/slurmdbd.pid"
DBD_LOG="$LOG_DIR/slurmdbd.log"
# Marker in the daemons' environment; slurmstepd inherits it from slurmd, so
# `stop` can find this cluster's step daemons.
MARKER="FLEETMEDIC_SLURM_CLUSTER=$STATE_DIR"

SBIN_PATH="/usr/sbin:/sbin:/usr/bin:/bin"
export PATH="$PATH:$SBIN_PATH"
export SLURM_CONF="$CONF"

log() { printf 'slurm.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    cat <<EOF
Usage: deploy/slurm.sh COMMAND

A local Slurm 22.05 cluster on 127.0.0.1 for tests and demos: munged,
slurmctld and one slurmd per node (nodes n1..nN, \`slurmd -N nX\`, each on
its own port) in the default partition "$FLEETMEDIC_SLURM_PARTITION". Everything
lives in the state dir; nothing is written to /etc. No accounting database
unless FLEETMEDIC_SLURM_ACCOUNTING=1 (then a MariaDB server and slurmdbd too).

Commands:
  start   install slurm-wlm + munge with apt if the daemons are missing,
          write the config, start munged, slurmctld and the slurmds, and wait
          until the controller answers and every node responds. Prints
          SLURM_CONF=<path> as the last line of stdout; export it so that
          scontrol/sinfo/squeue/sbatch/srun talk to this cluster.
          Idempotent: if this state dir's cluster runs, just prints the line;
          if only some slurmd is gone (killed to fake a node failure), starts
          just those and keeps jobs and node states. A fresh start of the
          controller keeps saved jobs but resumes nodes left drained/down and
          deletes reservations left by an earlier session (unless
          FLEETMEDIC_SLURM_KEEP_NODE_STATE=1). A cluster running with(out)
          accounting when FLEETMEDIC_SLURM_ACCOUNTING asks otherwise is
          restarted as asked.
  stop    cancel this cluster's jobs, then SIGTERM the slurmds, slurmctld,
          slurmdbd, mariadbd and munged (SIGKILL after
          \$FLEETMEDIC_SLURM_STOP_TIMEOUT s). Idempotent.
  status  print "running SLURM_CONF=<path> ..." (exit 0), or "not running" /
          "partly running (<daemons up>) ..." (exit 3)
  env     print SLURM_CONF=<path> of the running cluster (exit 3 if none)
  reset   stop and delete the state dir (jobs, node states, key, logs)
  help    this text

Environment (FLEETMEDIC_ prefix: Slurm's own commands read SLURM_* variables):
  FLEETMEDIC_STATE                 state root (default \$HOME/.cache/fleetmedic/run);
                                   the cluster lives in \$FLEETMEDIC_STATE/slurm
  FLEETMEDIC_SLURM_NODES           number of nodes n1..nN (default 4)
  FLEETMEDIC_SLURM_BENCH_NODES     nodes b00001..bM in a partition "bench" of
                                   their own, in slurm.conf but with no slurmd
                                   (default 0): for make bench-burst, whose
                                   drains need many nodes and no jobs. The
                                   controller sees them as not responding; a
                                   drain is recorded on them as on any node
  FLEETMEDIC_SLURM_NODE_CPUS       CPUs per node (default 4; not checked against
                                   the machine: SlurmdParameters=config_overrides)
  FLEETMEDIC_SLURM_NODE_MEMORY     RealMemory per node, MB (default 16000; not
                                   enforced)
  FLEETMEDIC_SLURM_NODE_GPUS       gres gpu per node (default 8, 0: no gres); the
                                   devices are symlinks to /dev/null in dev/, jobs
                                   get CUDA_VISIBLE_DEVICES as on a GPU node
  FLEETMEDIC_SLURM_PARTITION       default partition (default gpu)
  FLEETMEDIC_SLURMCTLD_PORT        controller port; default: the previous one if
                                   free, else a free port on 127.0.0.1
  FLEETMEDIC_SLURMD_BASE_PORT      if set, node nX listens on BASE+X-1; default:
                                   previous ports if free, else free ports
  FLEETMEDIC_SLURM_CRED_EXPIRE     AuthInfo cred_expire, s (default 10, min 5): a
                                   requeued job may start again this long (+1 s)
                                   after the requeue (Slurm's default is 120)
  FLEETMEDIC_SLURM_MIN_JOB_AGE     s a finished job stays visible to squeue and
                                   scontrol (default 120)
  FLEETMEDIC_SLURM_ACCOUNTING      1: job accounting, so that sacct answers (jobs
                                   and their steps: state, exit code, nodes,
                                   start, end): a MariaDB server (data in db/, on
                                   a free port of 127.0.0.1) and slurmdbd, both
                                   installed with apt if missing. Default 0:
                                   accounting_storage/none, sacct says "Slurm
                                   accounting storage is disabled"
  FLEETMEDIC_SLURM_KEEP_NODE_STATE 1: keep DRAIN/DOWN node states and reservations
                                   saved by an earlier session (default: cleared)
  FLEETMEDIC_SLURM_START_TIMEOUT   s to wait for the cluster (default 60)
  FLEETMEDIC_SLURM_STOP_TIMEOUT    s to wait after SIGTERM (default 30)

Files in the state dir: slurm.conf, gres.conf, ports, dev/nvidiaN,
munge/ (key, pid, log, seed; the socket too unless its path would be too long:
then \${TMPDIR:-/tmp}/fleetmedic-munge-<hash>/), log/ (slurmctld.log,
slurmd-nX.log, jobcomp.log: one line per finished or requeued job, *.out),
run/ (pid files), spool/nX/ (slurmd spool; reached through the symlink
\${TMPDIR:-/tmp}/fleetmedic-spool-<hash> when the path is too long),
state/ (StateSaveLocation: jobs, node states, reservations); with
accounting also slurmdbd.conf, db.pass, db/ (MariaDB's data; its socket in
run/ or \${TMPDIR:-/tmp}/fleetmedic-mysql-<hash>/), log/mariadbd.log and
log/slurmdbd.log.
EOF
}

# ---------------------------------------------------------------- install ---

ensure_installed() {
    local missing=() b
    for b in slurmctld slurmd munged scontrol sinfo squeue sbatch; do
        command -v "$b" >/dev/null || missing+=("$b")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "missing ${missing[*]}: installing slurm-wlm and munge with apt-get ..."
        local start=$SECONDS
        apt_install slurm-wlm munge
        for b in slurmctld slurmd munged scontrol; do
            command -v "$b" >/dev/null || die "$b still missing after installing slurm-wlm and munge"
        done
        log "installed slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null || echo '?') in $((SECONDS - start)) s"
    fi
    accounting || return 0
    missing=()
    for b in slurmdbd sacctmgr mariadbd mariadb-install-db mariadb; do
        command -v "$b" >/dev/null || missing+=("$b")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    log "missing ${missing[*]}: installing slurmdbd and mariadb-server with apt-get ..."
    local start=$SECONDS
    apt_install slurmdbd mariadb-server
    for b in slurmdbd mariadbd mariadb-install-db mariadb; do
        command -v "$b" >/dev/null || die "$b still missing after installing slurmdbd and mariadb-server"
    done
    log "installed slurmdbd and mariadb-server $(dpkg-query -W -f='${Version}' mariadb-server 2>/dev/null || echo '?') in $((SECONDS - start)) s"
}

accounting() { [[ "$FLEETMEDIC_SLURM_ACCOUNTING" == 1 ]]; }

# ------------------------------------------------------------------ ports ---



node_names() {
    local i
    for ((i = 1; i <= FLEETMEDIC_SLURM_NODES; i++)); do printf 'n%d\n' "$i"; done
}

node_range() {
    if ((FLEETMEDIC_SLURM_NODES == 1)); then printf 'n1'; else printf 'n[1-%d]' "$FLEETMEDIC_SLURM_NODES"; fi
}

bench_range() { printf 'b[00001-%05d]' "$FLEETMEDIC_SLURM_BENCH_NODES"; }

# previous port of NAME from the ports file, if any
prev_port() {
    [[ -f "$PORTS_FILE" ]] || return 1
    awk -v n="$1" '$1 == n { print $2; found = 1 } END { exit !found }' "$PORTS_FILE"
}

# Port choice: explicit value, else the previous one if still free, else new;
# never one already taken by this run ($TAKEN).
TAKEN=" "
pick_port() {
    local name="$1" explicit="$2" p
    if [[ -n "$explicit" ]]; then
        port_free "$explicit" || die "port $explicit ($name) on 127.0.0.1 is already in use"
        p="$explicit"
    elif p="$(prev_port "$name")" && [[ "$TAKEN" != *" $p "* ]] && port_free "$p"; then
        :
    else
        while :; do
            p="$(free_port)"
            [[ "$TAKEN" != *" $p "* ]] && break
        done
    fi
    TAKEN+="$p "
    printf '%s %s\n' "$name" "$p" >>"$PORTS_FILE.new"
}

choose_ports() {
    rm -f "$PORTS_FILE.new"
    pick_port slurmctld "${FLEETMEDIC_SLURMCTLD_PORT:-}"
    if accounting; then
        pick_port mariadbd ""
        pick_port slurmdbd ""
    fi
    local n i=0
    for n in $(node_names); do
        if [[ -n "${FLEETMEDIC_SLURMD_BASE_PORT:-}" ]]; then
            pick_port "$n" "$((FLEETMEDIC_SLURMD_BASE_PORT + i))"
        else
            pick_port "$n" ""
        fi
        i=$((i + 1))
    done
    mv -f "$PORTS_FILE.new" "$PORTS_FILE"
}

port_of() { awk -v n="$1" '$1 == n { print $2 }' "$PORTS_FILE"; }

# ------------------------------------------------------------- processes ---

munged_pid() { live_pid "$MUNGE_PID" "--key-file=$MUNGE_KEY"; }
ctld_pid() { live_pid "$CTLD_PID" "$CONF"; }
slurmd_pid() { live_pid "$RUN_DIR/slurmd-$1.pid" "$CONF"; }
db_pid() { live_pid "$DB_PID" "--datadir=$DB_DIR"; }
dbd_pid() { live_pid "$DBD_PID" slurmdbd; }


# slurmstepd processes started by this cluster's slurmds (they inherit MARKER).
stepd_pids() {
    local p
    for p in /proc/[0-9]*; do
        { tr '\0' ' ' <"$p/cmdline" | grep -q '^slurmstepd'; } 2>/dev/null || continue
        { tr '\0' '\n' <"$p/environ" | grep -qxF "$MARKER"; } 2>/dev/null || continue
        printf '%s\n' "${p#/proc/}"
    done
}

# ----------------------------------------------------------------- config ---

# Unix socket paths are limited to 108 bytes: PATH if it is short enough, else a
# socket NAME in a short dir in /tmp named by KIND and this state dir
short_socket() {
    local path="$1" kind="$2" name="$3" h
    if ((${#path} > 100)); then
        h="$(printf '%s' "$STATE_DIR" | sha1sum | cut -c1-12)"
        path="${TMPDIR:-/tmp}/fleetmedic-$kind-$h/$name"
        ((${#path} <= 100)) || die "no usable $kind socket path (TMPDIR too long)"
    fi
    printf '%s\n' "$path"
}

munge_socket_path() { short_socket "$MUNGE_DIR/munge.socket" munge munge.socket; }

# MariaDB's socket (only this script talks through it; slurmdbd uses TCP)
db_socket_path() { short_socket "$RUN_DIR/mysqld.sock" mysql mysqld.sock; }

# slurmstepd puts Unix sockets in the spool dir (<spool>/nX/nX_<job>.<step>,
# up to ~30 more bytes); with a long state dir, point Slurm at a short symlink.
spool_path() {
    if ((${#SPOOL_DIR} > 70)); then
        local h
        h="$(printf '%s' "$STATE_DIR" | sha1sum | cut -c1-12)"
        printf '%s\n' "${TMPDIR:-/tmp}/fleetmedic-spool-$h"
    else
        printf '%s\n' "$SPOOL_DIR"
    fi
}

# munged refuses a socket whose ancestors are not world-searchable unless
# forced (e.g. a state dir under a 0700 \$HOME). Jobs run as the cluster's own
# user here, so forcing is harmless.
needs_force() {
    local d
    d="$(dirname "$1")"
    while [[ "$d" != / ]]; do
        d="$(dirname "$d")"
        [[ "$(stat -c '%A' "$d")" == *x ]] || [[ "$(stat -c '%A' "$d")" == *t ]] || return 0
    done
    return 1
}

write_config() {
    local sock="$1" spool="$2" user n port gres_line="" gres_types=""
    # slurmdbd is reached over TCP, authenticated by the munged named in
    # AccountingStoragePass (AuthInfo's socket does not reach that connection)
    local accounting_lines="AccountingStorageType=accounting_storage/none"
    if accounting; then
        accounting_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$(port_of slurmdbd)
AccountingStoragePass=$sock"
    fi
    user="$(id -un)"
    if ((FLEETMEDIC_SLURM_NODE_GPUS > 0)); then
        gres_types="GresTypes=gpu"
        gres_line=" Gres=gpu:$FLEETMEDIC_SLURM_NODE_GPUS"
        # gres/gpu drops GPUs without File= and wants character devices:
        # dev/nvidiaN are symlinks to /dev/null. Jobs get CUDA_VISIBLE_DEVICES.
        local i
        mkdir -p "$STATE_DIR/dev"
        for ((i = 0; i < FLEETMEDIC_SLURM_NODE_GPUS; i++)); do
            ln -sfn /dev/null "$STATE_DIR/dev/nvidia$i"
        done
        cat >"$GRES_CONF" <<EOF
# Generated by deploy/slurm.sh -- edits are overwritten.
NodeName=$(node_range) Name=gpu File=$STATE_DIR/dev/nvidia[0-$((FLEETMEDIC_SLURM_NODE_GPUS - 1))]
EOF
    else
        rm -f "$GRES_CONF"
    fi
    {
        cat <<EOF
# Generated by deploy/slurm.sh -- edits are overwritten on every start.
ClusterName=fleetmedic
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(port_of slurmctld)
SlurmdPort=$(port_of n1)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock,cred_expire=$FLEETMEDIC_SLURM_CRED_EXPIRE
CommunicationParameters=NoAddrCache
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$accounting_lines
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1,bf_resolution=1
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MinJobAge=$FLEETMEDIC_SLURM_MIN_JOB_AGE
KillWait=5
InactiveLimit=0
SlurmdTimeout=30
SlurmctldTimeout=30
MessageTimeout=10
StateSaveLocation=$SAVE_DIR
SlurmdSpoolDir=$spool/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$CTLD_LOG
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
$gres_types
EOF
        # NodeHostname = node name, as on most real clusters, so sinfo's %n
        # and %N agree; every slurmd is reached through NodeAddr + its Port.
        for n in $(node_names); do
            port="$(port_of "$n")"
            printf 'NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%s CPUs=%s RealMemory=%s%s State=UNKNOWN\n' \
                "$n" "$n" "$port" "$FLEETMEDIC_SLURM_NODE_CPUS" "$FLEETMEDIC_SLURM_NODE_MEMORY" "$gres_line"
        done
        if ((FLEETMEDIC_SLURM_BENCH_NODES > 0)); then
            # no slurmd answers for these (port 1: refused at once); State=DOWN spares the controller's
            # first round of pings before it would mark them so itself
            printf 'NodeName=%s NodeAddr=127.0.0.1 Port=%s CPUs=%s RealMemory=%s State=DOWN\n' \
                "$(bench_range)" 1 "$FLEETMEDIC_SLURM_NODE_CPUS" "$FLEETMEDIC_SLURM_NODE_MEMORY"
            printf 'PartitionName=%s Nodes=%s Default=YES MaxTime=INFINITE State=UP\n' \
                "$FLEETMEDIC_SLURM_PARTITION" "$(node_range)"
            printf 'PartitionName=bench Nodes=%s Default=NO MaxTime=INFINITE State=UP\n' "$(bench_range)"
        else
            printf 'PartitionName=%s Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n' "$FLEETMEDIC_SLURM_PARTITION"
        fi
    } >"$CONF"
}

ensure_munge_key() {
    [[ -s "$MUNGE_KEY" ]] && return 0
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$MUNGE_KEY" >/dev/null
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
    chmod 0400 "$MUNGE_KEY"
}

# ------------------------------------------------------------- readiness ---

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

# Every node responds and is usable: idle/alloc/mix/completing, or drained /
# draining (a DRAIN from an earlier session is kept by slurmctld).
nodes_ready() {
    local out n st
    out="$(sinfo -h -N -p "$FLEETMEDIC_SLURM_PARTITION" -o '%N %t' 2>/dev/null)" || return 1
    for n in $(node_names); do
        st="$(awk -v n="$n" '$1 == n { print $2; exit }' <<<"$out")"
        [[ "$st" =~ ^(idle|alloc|mix|comp|drain|drng|drained|resv|maint)$ ]] || return 1
    done
}

# no node drained/down/not responding (used after resuming stale drains)
nodes_idle() {
    nodes_ready || return 1
    [[ -z "$(sinfo -h -N -p "$FLEETMEDIC_SLURM_PARTITION" -t drain,drng,down -o '%N' 2>/dev/null)" ]] || return 1
    ! sinfo -h -N -p "$FLEETMEDIC_SLURM_PARTITION" -o '%t' 2>/dev/null | grep -q '[*~#!%$@^-]$'
}

conf_has_accounting() { grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF" 2>/dev/null; }

# the accounting daemons that the config names are up
accounting_up() {
    conf_has_accounting || return 0
    db_pid >/dev/null && dbd_pid >/dev/null
}

# the config has the accounting now asked for
accounting_as_asked() {
    if accounting; then conf_has_accounting; else ! conf_has_accounting; fi
}

is_running() {
    munged_pid >/dev/null || return 1
    accounting_up || return 1
    ctld_pid >/dev/null || return 1
    local n
    for n in $(node_names); do slurmd_pid "$n" >/dev/null || return 1; done
    [[ -f "$CONF" ]] && ctld_up
}

show_logs() {
    local f
    for f in "$MUNGE_LOG" "$DB_LOG" "$LOG_DIR"/slurmdbd.out "$DBD_LOG" "$LOG_DIR"/slurmctld.out "$CTLD_LOG" \
        "$LOG_DIR"/slurmd-*.out "$LOG_DIR"/slurmd-*.log; do
        [[ -s "$f" ]] || continue
        printf '==> %s <==\n' "$f" >&2
        tail -n 25 "$f" >&2
    done
}

conf_line() { printf 'SLURM_CONF=%s\n' "$CONF"; }

# Serialise start/stop/reset of one state dir (e.g. parallel test runners).

# -------------------------------------------------------------- commands ---

start_slurmd() {
    local n="$1"
    mkdir -p "$SPOOL_DIR/$n"
    if [[ -s "$LOG_DIR/slurmd-$n.log" ]]; then
        mv -f "$LOG_DIR/slurmd-$n.log" "$LOG_DIR/slurmd-$n.log.prev"
    fi
    # 9>&-: no daemon may inherit (and so hold) the state-dir lock.
    if ! env "$MARKER" slurmd -f "$CONF" -N "$n" \
        </dev/null >"$LOG_DIR/slurmd-$n.out" 2>&1 9>&-; then
        show_logs
        log "error: slurmd for $n failed to start"
        return 1
    fi
}

wait_nodes_ready() {
    local deadline="$1"
    until nodes_ready; do
        if ((SECONDS >= deadline)); then
            sinfo -N -l >&2 || true
            show_logs
            log "error: nodes not ready within ${FLEETMEDIC_SLURM_START_TIMEOUT}s"
            return 1
        fi
        sleep 0.3
    done
}

# munged and slurmctld of this state dir are up with the current node set, but
# some slurmd is gone (e.g. killed to simulate a node failure): start just
# those, keeping jobs and node states.
heal_slurmds() {
    munged_pid >/dev/null && ctld_pid >/dev/null && [[ -f "$CONF" && -f "$PORTS_FILE" ]] || return 1
    accounting_up && accounting_as_asked || return 1
    [[ "$(grep -c '^NodeName=n' "$CONF")" -eq "$FLEETMEDIC_SLURM_NODES" ]] || return 1
    grep -q "^NodeName=$(bench_range) " "$CONF" || ((FLEETMEDIC_SLURM_BENCH_NODES == 0)) || return 1
    ctld_up || return 1
    local n missing=() start=$SECONDS
    for n in $(node_names); do
        grep -q "^NodeName=$n " "$CONF" || return 1
        slurmd_pid "$n" >/dev/null || missing+=("$n")
    done
    log "controller is up; restarting slurmd for ${missing[*]}"
    for n in "${missing[@]}"; do
        rm -f "$RUN_DIR/slurmd-$n.pid"
        start_slurmd "$n" || exit 1
    done
    wait_nodes_ready $((SECONDS + FLEETMEDIC_SLURM_START_TIMEOUT)) || exit 1
    log "slurmd for ${missing[*]} back in $((SECONDS - start)) s"
}

# MariaDB on 127.0.0.1 (its data in db/, made on first start) with a database
# user for slurmdbd, then slurmdbd: both before slurmctld, which registers
# with slurmdbd as it starts.
start_accounting() {
    local user dbsock pass
    user="$(id -un)"
    dbsock="$(db_socket_path)"
    mkdir -p "$(dirname "$dbsock")"
    local as_user=()
    [[ "$(id -u)" -eq 0 ]] && as_user=(--user=root)
    if [[ ! -d "$DB_DIR/mysql" ]]; then
        log "creating the accounting database in $DB_DIR"
        rm -rf "$DB_DIR"
        mariadb-install-db --no-defaults --datadir="$DB_DIR" --user="$user" \
            --auth-root-authentication-method=socket --auth-root-socket-user="$user" --skip-test-db \
            </dev/null >"$LOG_DIR/mariadb-install-db.out" 2>&1 9>&- || {
            cat "$LOG_DIR/mariadb-install-db.out" >&2
            return 1
        }
    fi
    [[ -s "$DB_PASS_FILE" ]] || (umask 077 && head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DB_PASS_FILE")
    pass="$(<"$DB_PASS_FILE")"
    log "starting mariadbd on 127.0.0.1:$(port_of mariadbd) (log $DB_LOG)"
    rm -f "$dbsock"
    # mariadbd stays in the foreground; in the background it writes its own pid file
    nohup env "$MARKER" mariadbd --no-defaults "${as_user[@]}" --datadir="$DB_DIR" --socket="$dbsock" \
        --bind-address=127.0.0.1 --port="$(port_of mariadbd)" --pid-file="$DB_PID" --log-error="$DB_LOG" \
        --skip-log-bin --innodb-buffer-pool-size=32M --innodb-lock-wait-timeout=900 \
        </dev/null >"$LOG_DIR/mariadbd.out" 2>&1 9>&- &
    local deadline=$((SECONDS + FLEETMEDIC_SLURM_START_TIMEOUT))
    until mariadb --no-defaults --socket="$dbsock" -u "$user" -e 'SELECT 1' >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "error: mariadbd did not answer within ${FLEETMEDIC_SLURM_START_TIMEOUT}s"
            return 1
        fi
        sleep 0.3
    done
    # the password on standard input, not in a command line that ps shows
    mariadb --no-defaults --socket="$dbsock" -u "$user" <<SQL || return 1
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL
    (
        umask 077
        cat >"$DBD_CONF" <<EOF
# Generated by deploy/slurm.sh -- edits are overwritten on every start.
AuthType=auth/munge
AuthInfo=socket=$(<"$MUNGE_SOCK_FILE")
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$(port_of slurmdbd)
SlurmUser=$user
PidFile=$DBD_PID
LogFile=$DBD_LOG
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$(port_of mariadbd)
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
    )
    log "starting slurmdbd on 127.0.0.1:$(port_of slurmdbd) (log $DBD_LOG)"
    [[ -s "$DBD_LOG" ]] && mv -f "$DBD_LOG" "$DBD_LOG.prev"
    # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF
    local dbd_start=$SECONDS
    env "$MARKER" slurmdbd </dev/null >"$LOG_DIR/slurmdbd.out" 2>&1 9>&- || return 1
    # slurmdbd writes its pid file once its tables are made (seconds on a first start)
    until sacctmgr -n list cluster >/dev/null 2>&1; do
        if ((SECONDS >= deadline)) || { ! dbd_pid >/dev/null && ((SECONDS > dbd_start + 15)); }; then
            log "error: slurmdbd did not answer within ${FLEETMEDIC_SLURM_START_TIMEOUT}s"
            return 1
        fi
        sleep 0.3
    done
}

cmd_start() {
    [[ "$FLEETMEDIC_SLURM_NODES" =~ ^[1-9][0-9]*$ ]] || die "FLEETMEDIC_SLURM_NODES must be a positive integer"
    [[ "$FLEETMEDIC_SLURM_BENCH_NODES" =~ ^[0-9]+$ ]] && ((FLEETMEDIC_SLURM_BENCH_NODES <= 99999)) \
        || die "FLEETMEDIC_SLURM_BENCH_NODES must be an integer from 0 to 99999"
    take_lock
    if is_running; then
        if accounting_as_asked; then
            log "already running (slurmctld pid $(ctld_pid))"
            conf_line
            return 0
        fi
        log "running $(conf_has_accounting && echo with || echo without) accounting; restarting as asked"
        do_stop
    fi
    ensure_installed
    if heal_slurmds; then
        conf_line
        return 0
    fi
    if munged_pid >/dev/null || ctld_pid >/dev/null || db_pid >/dev/null || dbd_pid >/dev/null \
        || [[ -n "$(ls "$RUN_DIR"/slurmd-*.pid 2>/dev/null)" ]]; then
        log "partly running; stopping the leftovers first"
        do_stop
    fi

    local start=$SECONDS sock
    mkdir -p "$LOG_DIR" "$RUN_DIR" "$SAVE_DIR" "$MUNGE_DIR"
    chmod 0700 "$MUNGE_DIR"
    sock="$(munge_socket_path)"
    mkdir -p "$(dirname "$sock")"
    chmod 0755 "$(dirname "$sock")"
    [[ "$(dirname "$sock")" == "$MUNGE_DIR" ]] && chmod 0711 "$MUNGE_DIR"
    printf '%s\n' "$sock" >"$MUNGE_SOCK_FILE"
    ensure_munge_key
    choose_ports
    local spool
    spool="$(spool_path)"
    mkdir -p "$SPOOL_DIR"
    if [[ "$spool" != "$SPOOL_DIR" ]]; then
        ln -sfn "$SPOOL_DIR" "$spool"
        log "spool dir path too long for Unix sockets; using symlink $spool"
    fi
    write_config "$sock" "$spool"
    local n

    # munged: everything under the state dir. 9>&-: no daemon may inherit
    # (and so hold) the state-dir lock.
    local force=()
    needs_force "$sock" && force=(--force)
    rm -f "$sock" "$sock.lock"
    log "starting munged (socket $sock)"
    if ! munged "${force[@]}" --key-file="$MUNGE_KEY" --socket="$sock" \
        --pid-file="$MUNGE_PID" --log-file="$MUNGE_LOG" --seed-file="$MUNGE_SEED" \
        </dev/null >"$LOG_DIR/munged.out" 2>&1 9>&-; then
        cat "$LOG_DIR/munged.out" >&2
        die "munged failed to start (log: $MUNGE_LOG)"
    fi

    if accounting; then
        start_accounting || {
            show_logs
            do_stop >/dev/null 2>&1 || true
            die "accounting (MariaDB, slurmdbd) failed to start"
        }
    fi

    log "starting slurmctld on 127.0.0.1:$(port_of slurmctld) (log $CTLD_LOG)"
    [[ -s "$CTLD_LOG" ]] && mv -f "$CTLD_LOG" "$CTLD_LOG.prev"
    local ctld_start=$SECONDS
    if ! env "$MARKER" slurmctld -f "$CONF" \
        </dev/null >"$LOG_DIR/slurmctld.out" 2>&1 9>&-; then
        show_logs
        do_stop >/dev/null 2>&1 || true
        die "slurmctld failed to start"
    fi
    local deadline=$((SECONDS + FLEETMEDIC_SLURM_START_TIMEOUT))
    until ctld_up; do
        if ((SECONDS >= deadline)) || { ! ctld_pid >/dev/null && ((SECONDS > ctld_start + 5)); }; then
            show_logs
            do_stop >/dev/null 2>&1 || true
            die "slurmctld did not answer within ${FLEETMEDIC_SLURM_START_TIMEOUT}s"
        fi
        sleep 0.3
    done

    for n in $(node_names); do
        start_slurmd "$n" || {
            do_stop >/dev/null 2>&1 || true
            exit 1
        }
    done
    log "started slurmd for $(node_range) on ports $(awk '$1 ~ /^n[0-9]+$/ { printf "%s ", $2 }' "$PORTS_FILE")"
    wait_nodes_ready "$deadline" || {
        do_stop >/dev/null 2>&1 || true
        exit 1
    }
    # slurmctld keeps DRAIN/DOWN (and the reason) and reservations across
    # restarts; start hands out clean nodes unless FLEETMEDIC_SLURM_KEEP_NODE_STATE=1.
    local drained resv r
    resv="$(scontrol show reservation -o 2>/dev/null | sed -n 's/^ReservationName=\([^ ]*\).*/\1/p')"
    drained="$(sinfo -h -N -p "$FLEETMEDIC_SLURM_PARTITION" -t drain,drng,down -o '%N' 2>/dev/null | sort -u | paste -sd, -)"
    if [[ "${FLEETMEDIC_SLURM_KEEP_NODE_STATE:-0}" == 1 ]]; then
        [[ -n "$resv" ]] && log "note: reservations kept from an earlier session: $(paste -sd' ' - <<<"$resv")"
    else
        for r in $resv; do
            log "deleting reservation $r (left by an earlier session)"
            scontrol delete ReservationName="$r" >&2 || true
        done
    fi
    if [[ -n "$drained" ]]; then
        if [[ "${FLEETMEDIC_SLURM_KEEP_NODE_STATE:-0}" == 1 ]]; then
            log "note: nodes $drained are still drained/down from an earlier session"
        else
            log "resuming nodes $drained (drained/down in an earlier session)"
            scontrol update NodeName="$drained" State=RESUME >&2 || true
            until nodes_idle; do
                if ((SECONDS >= deadline)); then
                    sinfo -N -l >&2 || true
                    die "nodes $drained did not return to service within ${FLEETMEDIC_SLURM_START_TIMEOUT}s"
                fi
                sleep 0.3
            done
        fi
    fi
    if accounting; then
        # slurmctld adds its cluster to the database when it registers; jobs
        # are accounted from then on
        until sacctmgr -n -P list cluster format=cluster,controlport 2>/dev/null | grep -q '^fleetmedic|[1-9]'; do
            if ((SECONDS >= deadline)); then
                show_logs
                die "slurmctld did not register with slurmdbd within ${FLEETMEDIC_SLURM_START_TIMEOUT}s"
            fi
            sleep 0.3
        done
    fi
    local with=""
    accounting && with=", with accounting (slurmdbd)"
    log "cluster up in $((SECONDS - start)) s: $(node_range) in partition $FLEETMEDIC_SLURM_PARTITION$with"
    conf_line
}

do_stop() {
    local n pids=() p
    # Cancel this cluster's jobs so no job outlives it (controller still up).
    if ctld_pid >/dev/null && ctld_up; then
        local ids
        ids="$(squeue -h -o '%A' 2>/dev/null | sort -un | paste -sd' ' -)"
        if [[ -n "$ids" ]]; then
            log "cancelling jobs $ids"
            # shellcheck disable=SC2086  # one word per job id
            scancel --quiet $ids 2>/dev/null || true
            local deadline=$((SECONDS + 15))
            while [[ -n "$(squeue -h -t R,CG,S -o '%i' 2>/dev/null | head -n1)" ]] && ((SECONDS < deadline)); do
                sleep 0.3
            done
        fi
    fi
    local f
    for f in "$RUN_DIR"/slurmd-*.pid; do
        [[ -e "$f" ]] || continue
        n="${f##*/slurmd-}"
        n="${n%.pid}"
        if p="$(slurmd_pid "$n")"; then pids+=("$p"); fi
    done
    # shellcheck disable=SC2046
    terminate slurmd $(printf '%s\n' "${pids[@]}" | sort -u)
    rm -f "$RUN_DIR"/slurmd-*.pid
    if p="$(ctld_pid)"; then terminate slurmctld "$p"; fi
    rm -f "$CTLD_PID"
    if p="$(dbd_pid)"; then terminate slurmdbd "$p"; fi
    rm -f "$DBD_PID"
    if p="$(db_pid)"; then terminate mariadbd "$p"; fi
    rm -f "$DB_PID"
    local dbsock
    dbsock="$(db_socket_path)"
    if [[ "$(dirname "$dbsock")" == */fleetmedic-mysql-* ]]; then
        rm -rf "$(dirname "$dbsock")"
    fi
    # Step daemons left over (e.g. slurmds killed earlier): kill them and
    # their process groups.
    pids=()
    for p in $(stepd_pids); do pids+=("$p"); done
    if [[ ${#pids[@]} -gt 0 ]]; then
        log "killing leftover slurmstepd ${pids[*]}"
        for p in "${pids[@]}"; do
            pkill -KILL -P "$p" 2>/dev/null || true
            kill -KILL "$p" 2>/dev/null || true
        done
    fi
    if p="$(munged_pid)"; then terminate munged "$p"; fi
    rm -f "$MUNGE_PID"
    if [[ -f "$MUNGE_SOCK_FILE" ]]; then
        local sock
        sock="$(<"$MUNGE_SOCK_FILE")"
        rm -f "$sock" "$sock.lock"
        if [[ "$(dirname "$sock")" == */fleetmedic-munge-* ]]; then
            rmdir "$(dirname "$sock")" 2>/dev/null || true
        fi
    fi
}

cmd_stop() {
    if ! munged_pid >/dev/null && ! ctld_pid >/dev/null && ! db_pid >/dev/null && ! dbd_pid >/dev/null \
        && [[ -z "$(ls "$RUN_DIR"/slurmd-*.pid 2>/dev/null)" ]] && [[ -z "$(stepd_pids)" ]]; then
        log "not running"
        return 0
    fi
    do_stop
    log "stopped"
}

cmd_status() {
    if is_running; then
        printf 'running %s (slurmctld pid %s, nodes %s)\n' "$(conf_line)" "$(ctld_pid)" "$(node_range)"
        return 0
    fi
    local parts=() n
    munged_pid >/dev/null && parts+=(munged)
    db_pid >/dev/null && parts+=(mariadbd)
    dbd_pid >/dev/null && parts+=(slurmdbd)
    ctld_pid >/dev/null && parts+=(slurmctld)
    for n in $(node_names); do slurmd_pid "$n" >/dev/null && parts+=("slurmd-$n"); done
    if [[ ${#parts[@]} -gt 0 ]]; then
        printf 'partly running (%s); run start to repair or stop\n' "${parts[*]}"
    else
        printf 'not running\n'
    fi
    return 3
}

cmd_env() {
    if is_running; then
        conf_line
        return 0
    fi
    log "not running"
    return 3
}

cmd_reset() {
    take_lock
    cmd_stop
    if [[ -d "$STATE_DIR" ]]; then
        log "deleting $STATE_DIR"
        # keep the lock file we hold; remove everything else
        local spool
        spool="$(spool_path)"
        [[ "$spool" != "$SPOOL_DIR" && -L "$spool" ]] && rm -f "$spool"
        find "$STATE_DIR" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +
    fi
}

main() {
    local cmd="${1:-help}"
    case "$cmd" in
        start) cmd_start ;;
        stop)
            take_lock
            cmd_stop
            ;;
        status) cmd_status ;;
        env) cmd_env ;;
        reset) cmd_reset ;;
        help | -h | --help) usage ;;
        *)
            usage >&2
            exit 2
            ;;
    esac
}

main "$@"
