#!/usr/bin/env bash
# Keycloak for local development and CI: the distribution from Maven Central (cached),
# started in dev mode on loopback with an in-memory database, and fleetmedic's realm
# (deploy/keycloak/realm.json) imported through the admin API. No Docker.
#
# Usage: deploy/keycloak.sh {fetch|start|stop|status|help}
set -euo pipefail

KEYCLOAK_VERSION="${KEYCLOAK_VERSION:-26.7.3}"
CACHE_ROOT="${FLEETMEDIC_CACHE:-$HOME/.cache/fleetmedic}"
STATE_ROOT="${FLEETMEDIC_STATE:-$HOME/.cache/fleetmedic/run}"
STATE_DIR="$STATE_ROOT/keycloak"
KC_ROOT="$CACHE_ROOT/keycloak"
KC_HOME="$KC_ROOT/keycloak-$KEYCLOAK_VERSION"
REALM_FILE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/keycloak/realm.json"
MVN="${MVN:-mvn}"
START_TIMEOUT="${FLEETMEDIC_KC_START_TIMEOUT:-240}"
DASHBOARD="${FLEETMEDIC_KC_DASHBOARD:-http://127.0.0.1:6066}"

log() { printf 'keycloak.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    cat <<EOF
Usage: deploy/keycloak.sh COMMAND

Keycloak $KEYCLOAK_VERSION in dev mode on 127.0.0.1, with the realm 'fleetmedic' from
deploy/keycloak/realm.json: realm roles viewer and operator; the confidential client
'fleetmedic' (the API's audience: client credentials, its service account an operator,
and the password grant); the public client 'fleetmedic-dashboard' (authorization code
with PKCE S256); the users ada (operator) and vic (viewer).

Passwords and the client secret are made at each start and written, with the URLs, to
<state>/keycloak/realm.env (mode 600). The database is in memory: a restart forgets
every change made since the import.

Commands:
  fetch    download the distribution (about 180 MB) from Maven Central with mvn into
           $KC_ROOT (once)
  start    fetch if needed, start Keycloak and import the realm; prints KEYCLOAK=<url>
           ISSUER=<issuer> last
  stop     stop it
  status   exit 0 when it runs (prints the same line as start)
  help     this text

Environment:
  FLEETMEDIC_KC_DASHBOARD   where the dashboard is served (the redirect URIs; default
                            $DASHBOARD)
  FLEETMEDIC_KC_START_TIMEOUT  seconds to wait for readiness (default $START_TIMEOUT)
  KC_JAVA_HOME              a JDK 21 or newer (default: the newest one found)
  FLEETMEDIC_STATE          state root (default ~/.cache/fleetmedic/run); this uses <root>/keycloak
  FLEETMEDIC_CACHE          download cache root (default ~/.cache/fleetmedic)
EOF
}

# the major version of the java at $1/bin/java (0 when it does not run)
java_major() {
    local v
    v="$("$1/bin/java" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')"
    printf '%s\n' "${v:-0}"
}

# a JDK that Keycloak $KEYCLOAK_VERSION runs on (21 or newer)
find_java() {
    local d best="" bestv=0 v
    if [[ -n "${KC_JAVA_HOME:-}" ]]; then
        v="$(java_major "$KC_JAVA_HOME")"
        ((v >= 21)) || die "KC_JAVA_HOME=$KC_JAVA_HOME is Java $v; Keycloak $KEYCLOAK_VERSION needs 21 or newer"
        printf '%s\n' "$KC_JAVA_HOME"
        return
    fi
    for d in ${JAVA_HOME:-} /usr/lib/jvm/* /opt/java/* /usr/local/java/*; do
        [[ -x "$d/bin/java" ]] || continue
        v="$(java_major "$d")"
        if ((v > bestv)); then best="$d"; bestv="$v"; fi
    done
    ((bestv >= 21)) || die "Keycloak $KEYCLOAK_VERSION needs Java 21 or newer; found ${bestv:-none} (set KC_JAVA_HOME)"
    printf '%s\n' "$best"
}

fetch() {
    [[ -x "$KC_HOME/bin/kc.sh" ]] && return 0
    command -v "$MVN" >/dev/null || die "mvn not found (needed to fetch Keycloak from Maven Central)"
    command -v unzip >/dev/null || die "unzip not found"
    cache_lock "$KC_ROOT" fetch 900
    [[ -x "$KC_HOME/bin/kc.sh" ]] && return 0
    local start=$SECONDS tmp="$KC_ROOT/.fetch.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    log "fetching org.keycloak:keycloak-quarkus-dist:$KEYCLOAK_VERSION:zip from Maven Central (about 180 MB, once) ..."
    if ! "$MVN" -B -q dependency:copy -Dartifact="org.keycloak:keycloak-quarkus-dist:$KEYCLOAK_VERSION:zip" \
        -DoutputDirectory="$tmp" </dev/null >"$tmp/mvn.log" 2>&1; then
        tail -n 30 "$tmp/mvn.log" >&2
        rm -rf "$tmp"
        die "mvn could not fetch Keycloak $KEYCLOAK_VERSION"
    fi
    unzip -q "$tmp/keycloak-quarkus-dist-$KEYCLOAK_VERSION.zip" -d "$tmp/x" || die "could not unzip the distribution"
    [[ -x "$tmp/x/keycloak-$KEYCLOAK_VERSION/bin/kc.sh" ]] || die "the distribution has no bin/kc.sh"
    rm -rf "$KC_HOME"
    mv "$tmp/x/keycloak-$KEYCLOAK_VERSION" "$KC_HOME"
    rm -rf "$tmp"
    exec 7>&-
    log "fetched Keycloak $KEYCLOAK_VERSION in $((SECONDS - start)) s ($KC_HOME)"
}

running() { live_pid "$STATE_DIR/keycloak.pid" "$STATE_DIR" >/dev/null; }

show() {
    # shellcheck disable=SC1091
    source "$STATE_DIR/realm.env"
    printf 'KEYCLOAK=%s ISSUER=%s\n' "$KEYCLOAK_URL" "$KEYCLOAK_ISSUER"
}

# the realm file with this start's secrets and the dashboard's address filled in
realm_json() {
    python3 - "$REALM_FILE" "$DASHBOARD" "$STATE_DIR/secrets.json" <<'PY'
import json, sys
realm, dashboard, secrets = sys.argv[1], sys.argv[2].rstrip("/"), json.load(open(sys.argv[3]))
text = open(realm).read()
for k, v in {"__FLEETMEDIC_CLIENT_SECRET__": secrets["client_secret"], "__ADA_PASSWORD__": secrets["ada"],
             "__VIC_PASSWORD__": secrets["vic"], "__FLEETMEDIC_DASHBOARD__": dashboard}.items():
    text = text.replace(k, v)
json.loads(text)
sys.stdout.write(text)
PY
}

# an admin token for the master realm
admin_token() {
    curl -fsS --max-time 20 -d grant_type=password -d client_id=admin-cli -d username=admin \
        --data-urlencode "password=$(cat "$STATE_DIR/admin.password")" \
        "$1/realms/master/protocol/openid-connect/token" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])'
}

start() {
    command -v curl >/dev/null || die "curl is needed to wait for Keycloak and import the realm"
    [[ -f "$REALM_FILE" ]] || die "no realm file at $REALM_FILE"
    fetch
    take_lock
    if running; then
        log "already running"
        show
        return 0
    fi
    local java port mport url pid deadline
    java="$(find_java)"
    mkdir -p "$STATE_DIR"
    chmod 700 "$STATE_DIR"
    port="$(free_port)"
    mport="$(free_port)"
    url="http://127.0.0.1:$port"
    (umask 077 && python3 - "$STATE_DIR" <<'PY'
import json, secrets, sys
d = sys.argv[1]
open(f"{d}/admin.password", "w").write(secrets.token_urlsafe(18))
json.dump({k: secrets.token_urlsafe(18) for k in ("client_secret", "ada", "vic")}, open(f"{d}/secrets.json", "w"))
PY
    )
    log "starting Keycloak $KEYCLOAK_VERSION on $url (Java $(java_major "$java"), dev mode, in-memory database)"
    # 9>&-: Keycloak must not inherit (and so hold) the state-dir lock
    JAVA_HOME="$java" KC_BOOTSTRAP_ADMIN_USERNAME=admin \
        KC_BOOTSTRAP_ADMIN_PASSWORD="$(cat "$STATE_DIR/admin.password")" \
        JAVA_OPTS_KC_HEAP="${FLEETMEDIC_KC_HEAP:--Xms64m -Xmx768m}" \
        nohup "$KC_HOME/bin/kc.sh" start-dev --http-host=127.0.0.1 --http-port="$port" \
        --http-management-port="$mport" --health-enabled=true --db=dev-mem --cache=local \
        -Dfleetmedic.state="$STATE_DIR" >"$STATE_DIR/keycloak.log" 2>&1 </dev/null 9>&- &
    pid=$!
    echo "$pid" >"$STATE_DIR/keycloak.pid"
    deadline=$((SECONDS + START_TIMEOUT))
    until curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$mport/health/ready" 2>/dev/null; do
        pid_alive "$pid" || { tail -n 40 "$STATE_DIR/keycloak.log" >&2; die "Keycloak exited during start (log $STATE_DIR/keycloak.log)"; }
        ((SECONDS < deadline)) || { tail -n 40 "$STATE_DIR/keycloak.log" >&2; die "Keycloak not ready within ${START_TIMEOUT}s (log $STATE_DIR/keycloak.log)"; }
        sleep 1
    done
    log "ready after $((SECONDS + START_TIMEOUT - deadline)) s; importing the realm fleetmedic"
    local token code
    token="$(admin_token "$url")" || die "could not sign in as the bootstrap admin"
    code="$(realm_json | curl -sS -o "$STATE_DIR/import.out" -w '%{http_code}' --max-time 60 -X POST \
        -H "Authorization: Bearer $token" -H 'Content-Type: application/json' --data-binary @- "$url/admin/realms")"
    [[ "$code" == 201 ]] || { cat "$STATE_DIR/import.out" >&2; die "realm import answered HTTP $code"; }
    python3 - "$STATE_DIR" "$url" "$port" "$mport" <<'PY'
import json, shlex, sys
d, url, port, mport = sys.argv[1:]
s = json.load(open(f"{d}/secrets.json"))
env = {"KEYCLOAK_URL": url, "KEYCLOAK_ISSUER": f"{url}/realms/fleetmedic", "KEYCLOAK_MANAGEMENT": f"http://127.0.0.1:{mport}",
       "KEYCLOAK_ADMIN_PASSWORD": open(f"{d}/admin.password").read().strip(), "KEYCLOAK_CLIENT_SECRET": s["client_secret"],
       "KEYCLOAK_ADA_PASSWORD": s["ada"], "KEYCLOAK_VIC_PASSWORD": s["vic"]}
with open(f"{d}/realm.env", "w") as f:
    f.writelines(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
PY
    chmod 600 "$STATE_DIR/realm.env"
    log "realm fleetmedic imported (users ada and vic; secrets in $STATE_DIR/realm.env)"
    show
}

stop_kc() {
    local pid
    pid="$(live_pid "$STATE_DIR/keycloak.pid" "$STATE_DIR")" || { rm -f "$STATE_DIR/keycloak.pid"; return 0; }
    STOP_TIMEOUT=30 terminate "Keycloak" "$pid"
    # kc.sh forwards the signal to its java; should it have been killed first, the java is
    # found by the state directory on its command line
    pkill -KILL -f -- "-Dfleetmedic.state=$STATE_DIR( |\$)" 2>/dev/null || true
    rm -f "$STATE_DIR/keycloak.pid"
}

cmd="${1:-help}"
shift || true
case "$cmd" in
fetch) fetch ;;
start) start ;;
stop)
    [[ -d "$STATE_DIR" ]] || exit 0
    take_lock
    stop_kc
    log "stopped" ;;
status)
    if running; then show; else log "not running"; exit 1; fi ;;
help | -h | --help) usage ;;
*) usage >&2; exit 2 ;;
esac
