#!/usr/bin/env bash
# Prometheus and Alertmanager for local development and CI, with fleetmedic's scrape
# config, alerting rules and routes (deploy/prometheus/). Built once from the Go module
# proxy and cached; no Docker.
#
# Usage: deploy/monitoring.sh {build|start|targets|stop|status|promtool|amtool|help}
set -euo pipefail

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"     # the Go module version of Prometheus 3.16.0
ALERTMANAGER_VERSION="${ALERTMANAGER_VERSION:-v0.35.0}"
CACHE_ROOT="${FLEETMEDIC_CACHE:-$HOME/.cache/fleetmedic}"
STATE_ROOT="${FLEETMEDIC_STATE:-$HOME/.cache/fleetmedic/run}"
STATE_DIR="$STATE_ROOT/monitoring"
BUILD_ROOT="$CACHE_ROOT/monitoring"
PROM_DIR="$BUILD_ROOT/prometheus-$PROMETHEUS_VERSION"
AM_DIR="$BUILD_ROOT/alertmanager-$ALERTMANAGER_VERSION"
CONF_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prometheus"
INTERVAL="${FLEETMEDIC_MON_INTERVAL:-15s}"
GROUP_WAIT="${FLEETMEDIC_MON_GROUP_WAIT:-30s}"
GROUP_INTERVAL="${FLEETMEDIC_MON_GROUP_INTERVAL:-5m}"
START_TIMEOUT="${FLEETMEDIC_MON_START_TIMEOUT:-60}"

log() { printf 'monitoring.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    cat <<EOF
Usage: deploy/monitoring.sh COMMAND

Prometheus ($PROMETHEUS_VERSION) and Alertmanager ($ALERTMANAGER_VERSION) on loopback,
configured from deploy/prometheus/ (prometheus.yml, rules.yml, alertmanager.yml).

Commands:
  build         build prometheus, promtool, alertmanager and amtool from the Go module
                proxy into $BUILD_ROOT (once; minutes on 2 cores)
  start         build if needed, start Alertmanager and Prometheus, wait until both are
                ready; prints PROMETHEUS=<url> ALERTMANAGER=<url> last
  targets LIST  the workers Prometheus scrapes now (host:port, comma-separated)
  stop          stop both
  status        exit 0 when both run
  promtool ARGS, amtool ARGS
                run the built tool (for example: promtool check rules deploy/prometheus/rules.yml)

Environment:
  FLEETMEDIC_SCRAPE          workers to scrape at start (host:port, comma-separated; default none)
  FLEETMEDIC_AM_WEBHOOK      where Alertmanager delivers notifications (default
                             http://127.0.0.1:9099/alerts, as in alertmanager.yml)
  FLEETMEDIC_MON_INTERVAL    scrape and rule evaluation interval (default 15s)
  FLEETMEDIC_MON_GROUP_WAIT, FLEETMEDIC_MON_GROUP_INTERVAL
                             Alertmanager's group_wait and group_interval (default 30s, 5m)
  FLEETMEDIC_STATE           state root (default ~/.cache/fleetmedic/run); this uses <root>/monitoring
  FLEETMEDIC_CACHE           build cache root (default ~/.cache/fleetmedic)
EOF
}

# the source directory of MODULE@VERSION in the module cache (downloaded if needed)
module_dir() {
    local dir
    dir="$(cd "$BUILD_ROOT" && GOFLAGS=-mod=mod go mod download -json "$1@$2" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
    [[ -n "$dir" && -d "$dir" ]] || die "the Go module proxy did not serve $1@$2"
    printf '%s\n' "$dir"
}

build_prometheus() {
    [[ -x "$PROM_DIR/bin/prometheus" && -x "$PROM_DIR/bin/promtool" ]] && return 0
    local start=$SECONDS tmp="$PROM_DIR.tmp" m=github.com/prometheus/prometheus
    log "building prometheus and promtool $PROMETHEUS_VERSION from the Go module proxy (once; 5-10 min on 2 cores) ..."
    rm -rf "$tmp"
    mkdir -p "$tmp/bin"
    # remove_all_sd: upstream's build tag that leaves out the cloud service discoveries
    # (AWS, Azure, GCE, Kubernetes, ... and their SDKs); static, file and HTTP discovery
    # stay, and deploy/prometheus/ uses file_sd_configs
    (cd "$BUILD_ROOT" && GOBIN="$tmp/bin" CGO_ENABLED=0 go install -trimpath -tags remove_all_sd -ldflags "-s -w" \
        "$m/cmd/prometheus@$PROMETHEUS_VERSION" "$m/cmd/promtool@$PROMETHEUS_VERSION") ||
        die "go install of prometheus $PROMETHEUS_VERSION failed"
    rm -rf "$PROM_DIR"
    mv "$tmp" "$PROM_DIR"
    log "built prometheus $PROMETHEUS_VERSION in $((SECONDS - start)) s ($PROM_DIR)"
}

# Alertmanager embeds its web UI (ui/app/dist), which the module does not ship (it is built
# with elm); the binary is built from a copy of the module with a one-page placeholder. The
# API (/api/v2) and the notifications are unaffected.
build_alertmanager() {
    [[ -x "$AM_DIR/bin/alertmanager" && -x "$AM_DIR/bin/amtool" ]] && return 0
    local start=$SECONDS tmp="$AM_DIR.tmp" src
    log "building alertmanager and amtool $ALERTMANAGER_VERSION from the Go module proxy (once; minutes) ..."
    src="$(module_dir github.com/prometheus/alertmanager "$ALERTMANAGER_VERSION")"
    rm -rf "$tmp"
    mkdir -p "$tmp/bin"
    cp -r "$src" "$tmp/src"
    chmod -R u+w "$tmp/src"
    mkdir -p "$tmp/src/ui/app/dist"
    printf '<!doctype html><title>Alertmanager</title><p>This build has no web UI; the API is at /api/v2/.</p>\n' \
        >"$tmp/src/ui/app/dist/index.html"
    (cd "$tmp/src" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/bin/" \
        ./cmd/alertmanager ./cmd/amtool) || die "go build of alertmanager $ALERTMANAGER_VERSION failed"
    rm -rf "$tmp/src"
    rm -rf "$AM_DIR"
    mv "$tmp" "$AM_DIR"
    log "built alertmanager $ALERTMANAGER_VERSION in $((SECONDS - start)) s ($AM_DIR)"
}

build() {
    command -v go >/dev/null || die "go is needed to build Prometheus and Alertmanager"
    cache_lock "$BUILD_ROOT" build 3600
    build_alertmanager
    build_prometheus
    exec 7>&-
}

# targets.json for file service discovery: the comma-separated host:port list in $1
write_targets() {
    local list="$1" out="" t
    IFS=',' read -r -a items <<<"$list"
    for t in "${items[@]}"; do
        t="${t// /}"
        [[ -z "$t" ]] && continue
        [[ "$t" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]] || die "scrape target '$t' is not host:port"
        out+="${out:+, }\"$t\""
    done
    printf '[{"targets": [%s]}]\n' "$out" >"$STATE_DIR/targets.json.tmp"
    mv "$STATE_DIR/targets.json.tmp" "$STATE_DIR/targets.json"
}

wait_ready() {
    local what="$1" url="$2" pid="$3" logfile="$4" deadline=$((SECONDS + START_TIMEOUT))
    until curl -fsS -o /dev/null "$url/-/ready" 2>/dev/null; do
        pid_alive "$pid" || { tail -n 30 "$logfile" >&2; die "$what exited during start (log $logfile)"; }
        ((SECONDS < deadline)) || { tail -n 30 "$logfile" >&2; die "$what not ready within ${START_TIMEOUT}s (log $logfile)"; }
        sleep 0.3
    done
}

urls() {
    printf 'PROMETHEUS=http://127.0.0.1:%s ALERTMANAGER=http://127.0.0.1:%s\n' \
        "$(cat "$STATE_DIR/prometheus.port")" "$(cat "$STATE_DIR/alertmanager.port")"
}

running() {
    live_pid "$STATE_DIR/prometheus.pid" "$STATE_DIR" >/dev/null &&
        live_pid "$STATE_DIR/alertmanager.pid" "$STATE_DIR" >/dev/null
}

start() {
    command -v curl >/dev/null || die "curl is needed to wait for Prometheus and Alertmanager"
    build
    take_lock
    if running; then
        log "already running"
        urls
        return 0
    fi
    stop_all
    mkdir -p "$STATE_DIR/prometheus-data" "$STATE_DIR/alertmanager-data"
    local pport aport webhook="${FLEETMEDIC_AM_WEBHOOK:-}"
    pport="$(free_port)"
    aport="$(free_port)"
    cp "$CONF_DIR/rules.yml" "$STATE_DIR/rules.yml"
    sed -e "s/^\(  scrape_interval:\).*/\1 $INTERVAL/" -e "s/^\(  evaluation_interval:\).*/\1 $INTERVAL/" \
        "$CONF_DIR/prometheus.yml" >"$STATE_DIR/prometheus.yml"
    sed -e "s|^\(  group_wait:\).*|\1 $GROUP_WAIT|" -e "s|^\(  group_interval:\).*|\1 $GROUP_INTERVAL|" \
        -e "s|^\(      group_wait:\).*|\1 $GROUP_WAIT|" \
        ${webhook:+-e "s|url: http://127.0.0.1:9099/alerts|url: $webhook|"} \
        "$CONF_DIR/alertmanager.yml" >"$STATE_DIR/alertmanager.yml"
    write_targets "${FLEETMEDIC_SCRAPE:-}"
    printf '[{"targets": ["127.0.0.1:%s"]}]\n' "$aport" >"$STATE_DIR/alertmanagers.json"
    "$AM_DIR/bin/amtool" check-config "$STATE_DIR/alertmanager.yml" >/dev/null ||
        die "alertmanager.yml does not check (amtool check-config $STATE_DIR/alertmanager.yml)"
    "$PROM_DIR/bin/promtool" check config "$STATE_DIR/prometheus.yml" >/dev/null ||
        die "prometheus.yml does not check (promtool check config $STATE_DIR/prometheus.yml)"
    printf '%s\n' "$pport" >"$STATE_DIR/prometheus.port"
    printf '%s\n' "$aport" >"$STATE_DIR/alertmanager.port"
    # 9>&-: neither daemon may inherit (and so hold) the state-dir lock
    log "starting Alertmanager on 127.0.0.1:$aport"
    nohup "$AM_DIR/bin/alertmanager" --config.file="$STATE_DIR/alertmanager.yml" \
        --storage.path="$STATE_DIR/alertmanager-data" --web.listen-address="127.0.0.1:$aport" \
        --cluster.listen-address= >"$STATE_DIR/alertmanager.log" 2>&1 </dev/null 9>&- &
    echo $! >"$STATE_DIR/alertmanager.pid"
    wait_ready Alertmanager "http://127.0.0.1:$aport" "$!" "$STATE_DIR/alertmanager.log"
    log "starting Prometheus on 127.0.0.1:$pport (scrape and rules every $INTERVAL)"
    nohup "$PROM_DIR/bin/prometheus" --config.file="$STATE_DIR/prometheus.yml" \
        --storage.tsdb.path="$STATE_DIR/prometheus-data" --web.listen-address="127.0.0.1:$pport" \
        --web.enable-lifecycle >"$STATE_DIR/prometheus.log" 2>&1 </dev/null 9>&- &
    echo $! >"$STATE_DIR/prometheus.pid"
    wait_ready Prometheus "http://127.0.0.1:$pport" "$!" "$STATE_DIR/prometheus.log"
    log "ready (logs in $STATE_DIR)"
    urls
}

stop_all() {
    local p pids=()
    for p in prometheus alertmanager; do
        pid="$(live_pid "$STATE_DIR/$p.pid" "$STATE_DIR")" && pids+=("$pid")
    done
    STOP_TIMEOUT=20 terminate "Prometheus and Alertmanager" "${pids[@]}"
    rm -f "$STATE_DIR/prometheus.pid" "$STATE_DIR/alertmanager.pid"
}

cmd="${1:-help}"
shift || true
case "$cmd" in
build) build ;;
start) start ;;
targets)
    [[ -d "$STATE_DIR" ]] || die "not started"
    write_targets "${1:-}"
    log "scraping now: ${1:-nothing}" ;;
stop)
    [[ -d "$STATE_DIR" ]] || exit 0
    take_lock
    stop_all
    log "stopped" ;;
status)
    if running; then urls; else log "not running"; exit 1; fi ;;
promtool) build; exec "$PROM_DIR/bin/promtool" "$@" ;;
amtool) build; exec "$AM_DIR/bin/amtool" "$@" ;;
help | -h | --help) usage ;;
*) usage >&2; exit 2 ;;
esac
