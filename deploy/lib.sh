# shellcheck shell=bash
# Shared by deploy/kafka.sh and deploy/slurm.sh (sourced; expects log, die and STATE_DIR).

# hold the state directory's lock (fd 9) so two starts/stops never race
take_lock() {
    mkdir -p "$STATE_DIR"
    if command -v flock >/dev/null; then
        exec 9>"$STATE_DIR/.lock"
        flock -w 180 9 || die "could not lock $STATE_DIR/.lock within 180 s"
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
