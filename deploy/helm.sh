#!/usr/bin/env bash
# Helm v4, built once from the Go module proxy and cached, to lint, render and install
# the chart in deploy/helm/fleetmedic. No Docker, no download site.
#
# Usage: deploy/helm.sh {build|path|help} | deploy/helm.sh HELM-ARGS...
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v4.3.2}"
CACHE_ROOT="${FLEETMEDIC_CACHE:-$HOME/.cache/fleetmedic}"
BUILD_ROOT="$CACHE_ROOT/helm"
HELM_DIR="$BUILD_ROOT/$HELM_VERSION"
HELM="$HELM_DIR/bin/helm"

log() { printf 'helm.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    cat <<EOF2
Usage: deploy/helm.sh COMMAND | deploy/helm.sh HELM-ARGS...

Helm $HELM_VERSION (helm.sh/helm/v4), built from the Go module proxy into $HELM_DIR
the first time it is needed (minutes on 2 cores), then run with the arguments given.

Commands:
  build     build it (once)
  path      build if needed and print the binary's path
  help      this text
  anything else is passed to helm, for example:
            deploy/helm.sh lint --strict deploy/helm/fleetmedic
            deploy/helm.sh template fleetmedic deploy/helm/fleetmedic -n fleetmedic

Environment:
  HELM_VERSION      the module version (default $HELM_VERSION)
  FLEETMEDIC_CACHE  build cache root (default ~/.cache/fleetmedic)
EOF2
}

build() {
    [[ -x "$HELM" ]] && return 0
    command -v go >/dev/null || die "go is needed to build Helm"
    cache_lock "$BUILD_ROOT" build 3600
    [[ -x "$HELM" ]] && return 0
    local start=$SECONDS tmp="$HELM_DIR.tmp"
    log "building helm $HELM_VERSION from the Go module proxy (once; minutes on 2 cores) ..."
    rm -rf "$tmp"
    mkdir -p "$tmp/bin"
    (cd "$BUILD_ROOT" && GOBIN="$tmp/bin" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
        "helm.sh/helm/v4/cmd/helm@$HELM_VERSION") || die "go install of helm $HELM_VERSION failed"
    rm -rf "$HELM_DIR"
    mv "$tmp" "$HELM_DIR"
    exec 7>&-
    log "built helm $HELM_VERSION in $((SECONDS - start)) s ($HELM)"
}

case "${1:-help}" in
build) build ;;
path) build; printf '%s\n' "$HELM" ;;
help | -h | --help) usage ;;
*)
    build
    # keep Helm's own cache, config and data out of the user's home directories
    export HELM_CACHE_HOME="${HELM_CACHE_HOME:-$BUILD_ROOT/home/cache}"
    export HELM_CONFIG_HOME="${HELM_CONFIG_HOME:-$BUILD_ROOT/home/config}"
    export HELM_DATA_HOME="${HELM_DATA_HOME:-$BUILD_ROOT/home/data}"
    exec "$HELM" "$@" ;;
esac
