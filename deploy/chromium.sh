#!/usr/bin/env bash
# Headless Chromium and its WebDriver from Debian's packages, for the dashboard's browser
# test.  `deploy/chromium.sh ensure` installs chromium and chromium-driver when missing and
# prints the paths of the browser and the driver (last two lines: CHROME=..., DRIVER=...).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf 'chromium.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$HERE/lib.sh"

usage() {
    cat <<USAGE
usage: deploy/chromium.sh ensure|paths|help

ensure   install Debian's chromium and chromium-driver if missing (apt-get, as root or
         with sudo), then print CHROME=<browser> and DRIVER=<chromedriver>
paths    print the paths without installing (exit 1 when either is missing)
USAGE
}

find_paths() {
    CHROME=$(command -v chromium || command -v chromium-browser || true)
    DRIVER=$(command -v chromedriver || true)
    [[ -z "$DRIVER" && -x /usr/lib/chromium/chromedriver ]] && DRIVER=/usr/lib/chromium/chromedriver
    [[ -n "$CHROME" && -n "$DRIVER" ]]
}

case "${1:-help}" in
    ensure)
        if ! find_paths; then
            log "installing chromium and chromium-driver with apt-get ..."
            start=$SECONDS
            apt_install chromium chromium-driver
            find_paths || die "chromium or chromedriver still missing after installing them"
            log "installed chromium $(dpkg-query -W -f='${Version}' chromium 2>/dev/null || echo '?') in $((SECONDS - start)) s"
        fi
        echo "CHROME=$CHROME"
        echo "DRIVER=$DRIVER"
        ;;
    paths)
        find_paths || exit 1
        echo "CHROME=$CHROME"
        echo "DRIVER=$DRIVER"
        ;;
    help|-h|--help) usage ;;
    *) usage >&2; exit 2 ;;
esac
