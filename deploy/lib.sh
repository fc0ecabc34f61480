# shellcheck shell=bash
# Shared by the service scripts of deploy/ (sourced; expects log,
# die and STATE_DIR; terminate reads STOP_TIMEOUT, default 30 s).

# hold the state directory's lock (fd 9) so two starts/stops never race
take_lock() {
    mkdir -p "$STATE_DIR"
    if command -v flock >/dev/null; then
        exec 9>"$STATE_DIR/.lock"
        flock -w 180 9 || die "could not lock $STATE_DIR/.lock within 180 s"
    fi
}

# hold a cache directory's lock (fd 7) so two builds or fetches into it never race:
# cache_lock DIR NAME SECONDS
cache_lock() {
    mkdir -p "$1"
    exec 7>"$1/.$2.lock"
    if command -v flock >/dev/null; then
        flock -w "$3" 7 || die "$1/.$2.lock held for $3 s"
    fi
}

# a free TCP port on 127.0.0.1
free_port() {
    python3 -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# exit status 0 when 127.0.0.1:PORT can be bound
port_free() {
    python3 - "$1" <<'PY'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
PY
}

# run a command as root: directly when we are root, else through sudo -n
need_root_cmd() {
    if [[ "$(id -u)" -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo -n "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# apt-get install PACKAGES quietly; the package lists are updated only when they are
# empty or the first install fails
apt_install() {
    command -v apt-get >/dev/null || die "no apt-get to install $*"
    if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
        need_root_cmd apt-get update -qq
    fi
    if ! need_root_cmd env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$@" >&2; then
        need_root_cmd apt-get update -qq
        need_root_cmd env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "$@" >&2
    fi
}

# exit status 0 when PID is alive and not a zombie
pid_alive() {
    local st
    kill -0 "$1" 2>/dev/null || return 1
    [[ -r "/proc/$1/stat" ]] || return 0
    st="$(sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f1)"
    [[ "$st" != Z && "$st" != X ]]
}

# the pid written in FILE (empty when there is none)
file_pid() { [[ -f "$1" ]] && tr -dc '0-9' <"$1"; true; }

# pid from FILE if it is alive, not a zombie, and its command line contains NEEDLE
# (so a recycled pid is not mistaken for ours)
live_pid() {
    local file="$1" needle="$2" pid
    pid="$(file_pid "$file")"
    [[ -n "$pid" ]] && pid_alive "$pid" || return 1
    if [[ -r "/proc/$pid/cmdline" ]]; then
        tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$needle" || return 1
    fi
    printf '%s\n' "$pid"
}

# terminate WHAT PIDS...: SIGTERM, wait up to $STOP_TIMEOUT s, then SIGKILL
terminate() {
    local what="$1" pid timeout="${STOP_TIMEOUT:-30}"
    shift
    [[ $# -gt 0 ]] || return 0
    log "stopping $what (pid $*)"
    kill -TERM "$@" 2>/dev/null || true
    local deadline=$((SECONDS + timeout))
    for pid in "$@"; do
        while pid_alive "$pid"; do
            if ((SECONDS >= deadline)); then
                log "$what pid $pid still alive after ${timeout}s; sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
                sleep 0.2
                break
            fi
            sleep 0.2
        done
    done
}
