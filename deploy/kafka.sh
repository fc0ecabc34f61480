#!/usr/bin/env bash
# Embedded Apache Kafka (KRaft, broker+controller in one JVM per node) for local
# development and CI: one node by default, or a replicated cluster of KAFKA_BROKERS
# nodes on loopback. Jars come from Maven Central via mvn; no Docker.
#
# Usage: deploy/kafka.sh {fetch|start|stop|status|bootstrap|kill N|reset|help}
# See `deploy/kafka.sh help` for the environment variables.
set -euo pipefail

# Newest broker version whose smoke test (aiokafka + Faust) passes; see
# docs/decisions/0001-kafka-broker-version.md.
readonly DEFAULT_KAFKA_VERSION="4.4.0"

KAFKA_VERSION="${KAFKA_VERSION:-$DEFAULT_KAFKA_VERSION}"
CACHE_ROOT="${FLEETMEDIC_CACHE:-$HOME/.cache/fleetmedic}"
STATE_ROOT="${FLEETMEDIC_STATE:-$HOME/.cache/fleetmedic/run}"
KAFKA_HEAP="${KAFKA_HEAP:--Xms256m -Xmx512m}"
KAFKA_START_TIMEOUT="${KAFKA_START_TIMEOUT:-90}"
KAFKA_STOP_TIMEOUT="${KAFKA_STOP_TIMEOUT:-30}"
JAVA="${JAVA:-java}"
MVN="${MVN:-mvn}"
readonly DEPENDENCY_PLUGIN="org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
# Log4j 2 line used for Kafka 4.x logging (binding + core aligned via its BOM).
readonly LOG4J2_VERSION="2.25.5"

KAFKA_BROKERS="${KAFKA_BROKERS:-1}"
KAFKA_HOME="$CACHE_ROOT/kafka/$KAFKA_VERSION"
LIBS_DIR="$KAFKA_HOME/libs"
FETCH_MARKER="$KAFKA_HOME/.fetched"
# one node: $STATE_ROOT/kafka; a cluster: $STATE_ROOT/kafka-cluster/node-N (N = node.id)
CLUSTER_DIR="$STATE_ROOT/kafka-cluster"

# point the per-node paths at node N's directory (N=0: the single node)
select_node() {
    NODE_ID="$1"
    if [[ "$NODE_ID" -eq 0 ]]; then
        STATE_DIR="$STATE_ROOT/kafka"
    else
        STATE_DIR="$CLUSTER_DIR/node-$NODE_ID"
    fi
    DATA_DIR="$STATE_DIR/data"
    PID_FILE="$STATE_DIR/kafka.pid"
    PORT_FILE="$STATE_DIR/port"
    CPORT_FILE="$STATE_DIR/controller.port"
    VERSION_FILE="$STATE_DIR/version"
    SERVER_LOG="$STATE_DIR/server.log"
    PROPS_FILE="$STATE_DIR/server.properties"
}
select_node 0

log() { printf 'kafka.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    cat <<EOF
Usage: deploy/kafka.sh COMMAND

Embedded Apache Kafka (KRaft mode, broker and controller in one JVM per node)
bound to 127.0.0.1. Needs java (17+), mvn (for the first fetch) and python3.
One node by default; KAFKA_BROKERS=3 runs a replicated cluster of three nodes
(each a broker and a controller voter; replication factor 3,
min.insync.replicas=2), in a state directory of its own.

Commands:
  fetch      download the broker jars from Maven Central into the cache
             (skipped when already cached)
  start      fetch if needed, format storage if needed, start the broker in the
             background and wait until it serves; prints the bootstrap address
             (127.0.0.1:PORT) as the last line of stdout. Idempotent: if the
             broker of this state dir already runs, just prints its address.
  stop       SIGTERM, wait up to \$KAFKA_STOP_TIMEOUT s, then SIGKILL. Idempotent.
             With KAFKA_BROKERS>1, starts every node that is not running
             (so it also restarts killed nodes) and prints the addresses of
             all nodes, comma-separated.
  status     print "running <addr>" (exit 0) or "not running" (exit 3); for a
             cluster one line per node, exit 0 only when all run
  bootstrap  print the bootstrap address of the running broker (exit 3 if none)
  kill N     cluster only: SIGKILL node N (its node.id, 1..KAFKA_BROKERS), as a
             crash would; "start" brings it back
  reset      stop and delete the state dir (all topics and offsets)
  help       this text

Environment:
  KAFKA_VERSION        broker version (default $DEFAULT_KAFKA_VERSION)
  KAFKA_BROKERS        nodes: 1 (default) or a cluster of N >= 3, state in
                       \$FLEETMEDIC_STATE/kafka-cluster/node-N; KAFKA_PORT and
                       KAFKA_CONTROLLER_PORT apply to the single node only
  KAFKA_PORT           client (PLAINTEXT) port; default: previous port if free,
                       else a free port picked on 127.0.0.1
  KAFKA_CONTROLLER_PORT  KRaft controller port; default: picked like KAFKA_PORT
  FLEETMEDIC_CACHE     jar cache root (default \$HOME/.cache/fleetmedic);
                       jars go to \$FLEETMEDIC_CACHE/kafka/<version>/libs
  FLEETMEDIC_STATE     state root (default \$HOME/.cache/fleetmedic/run);
                       data, logs, pid and port live in \$FLEETMEDIC_STATE/kafka
  KAFKA_HEAP           JVM heap options (default "-Xms256m -Xmx512m")
  KAFKA_START_TIMEOUT  seconds to wait for the broker to serve (default 90)
  KAFKA_STOP_TIMEOUT   seconds to wait after SIGTERM (default 30)

Files in the state dir: server.properties, server.log (+ server.log.prev),
format.log, kafka.pid, port, controller.port, version, data/ (KRaft log dir).
EOF
}

major_version() { printf '%s' "${KAFKA_VERSION%%.*}"; }

# ---------------------------------------------------------------- fetch ----

write_pom() {
    local pom="$1" logging_deps managed=""
    if [[ "$(major_version)" -ge 4 ]]; then
        # Kafka 4.x: SLF4J 1.7 API -> Log4j 2 (kafka-server already pulls
        # log4j-core); the BOM keeps every log4j artifact on one version.
        managed="
  <dependencyManagement><dependencies>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-bom</artifactId><version>$LOG4J2_VERSION</version><type>pom</type><scope>import</scope></dependency>
  </dependencies></dependencyManagement>"
        logging_deps='
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId></dependency>'
    else
        # Kafka 3.x: SLF4J 1.7 -> reload4j (log4j 1.x API).
        logging_deps='
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-reload4j</artifactId><version>1.7.36</version></dependency>'
    fi
    cat >"$pom" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.fleetmedic</groupId>
  <artifactId>kafka-broker-fetch</artifactId>
  <version>0</version>
  <packaging>pom</packaging>$managed
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-server</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-metadata</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-raft</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-storage</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId><version>$KAFKA_VERSION</version></dependency>$logging_deps
  </dependencies>
</project>
EOF
}

# Name of the StorageTool main class inside the fetched jars: kafka.tools in
# 3.9-4.4 (core); org.apache.kafka.tools is preferred should it move there.
detect_storage_tool() {
    python3 - "$LIBS_DIR" <<'PY'
import glob, sys, zipfile
candidates = ["org/apache/kafka/tools/StorageTool.class", "kafka/tools/StorageTool.class"]
found = set()
for jar in glob.glob(sys.argv[1] + "/*.jar"):
    with zipfile.ZipFile(jar) as z:
        found.update(n for n in z.namelist() if n in candidates)
for c in candidates:
    if c in found:
        print(c[: -len(".class")].replace("/", "."))
        sys.exit(0)
sys.exit("StorageTool class not found in " + sys.argv[1])
PY
}

cmd_fetch() {
    if [[ -f "$FETCH_MARKER" ]]; then
        log "Kafka $KAFKA_VERSION already cached in $LIBS_DIR"
        return 0
    fi
    command -v "$MVN" >/dev/null || die "mvn not found (needed to fetch Kafka jars)"
    log "fetching Kafka $KAFKA_VERSION from Maven Central into $LIBS_DIR ..."
    local tmp start
    start=$SECONDS
    tmp="$(mktemp -d)"
    write_pom "$tmp/pom.xml"
    rm -rf "$LIBS_DIR"
    mkdir -p "$LIBS_DIR"
    if ! "$MVN" -q -B -f "$tmp/pom.xml" \
        "$DEPENDENCY_PLUGIN:copy-dependencies" \
        -DincludeScope=runtime -DoutputDirectory="$LIBS_DIR" </dev/null >"$tmp/mvn.log" 2>&1; then
        tail -n 40 "$tmp/mvn.log" >&2
        rm -rf "$tmp"
        die "mvn could not fetch Kafka $KAFKA_VERSION"
    fi
    rm -rf "$tmp"
    local tool
    tool="$(detect_storage_tool)" || die "fetched jars lack StorageTool"
    printf '%s\n' "$tool" >"$KAFKA_HOME/storage-tool"
    printf 'kafka %s fetched %s\n' "$KAFKA_VERSION" "$(date -u +%FT%TZ)" >"$FETCH_MARKER"
    log "fetched Kafka $KAFKA_VERSION ($(find "$LIBS_DIR" -name '*.jar' | wc -l) jars) in $((SECONDS - start)) s"
}

# ---------------------------------------------------------------- state ----



port_answers() {
    python3 - "$1" <<'PY'
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
except OSError:
    sys.exit(1)
PY
}

random_cluster_id() {
    python3 -c 'import base64, uuid
while True:
    s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if not s.startswith("-"):
        print(s); break'
}

# pid of the broker of this state dir, if it is alive (and really ours).
running_pid() { live_pid "$PID_FILE" "$PROPS_FILE"; }

bootstrap_addr() { printf '127.0.0.1:%s\n' "$(<"$PORT_FILE")"; }

is_running() {
    running_pid >/dev/null && [[ -f "$PORT_FILE" ]] && port_answers "$(<"$PORT_FILE")"
}

# Port choice: explicit env var, else the previous one if still free, else new.
choose_port() {
    local env_value="$1" file="$2" avoid="${3:-}" p
    if [[ -n "$env_value" ]]; then
        printf '%s\n' "$env_value"
        return
    fi
    if [[ -f "$file" ]]; then
        p="$(<"$file")"
        if [[ "$p" != "$avoid" ]] && port_free "$p"; then
            printf '%s\n' "$p"
            return
        fi
    fi
    while :; do
        p="$(free_port)"
        [[ "$p" != "$avoid" ]] && break
    done
    printf '%s\n' "$p"
}

write_config() {
    # PORT CPORT [VOTERS RF MIN_ISR]: a single node by default
    local port="$1" cport="$2" voters="${3:-1@127.0.0.1:$2}" rf="${4:-1}" isr="${5:-1}"
    local id=$((NODE_ID > 0 ? NODE_ID : 1))
    cat >"$PROPS_FILE" <<EOF
# Generated by deploy/kafka.sh for Kafka $KAFKA_VERSION -- edits are overwritten.
process.roles=broker,controller
node.id=$id
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$DATA_DIR
num.partitions=8
default.replication.factor=$rf
min.insync.replicas=$isr
auto.create.topics.enable=true
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
unclean.leader.election.enable=false
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=168
log.segment.bytes=67108864
EOF
    # Console logging only; nohup sends it to server.log.
    cat >"$STATE_DIR/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = INFO
logger.request.name = kafka.request.logger
logger.request.level = WARN
EOF
    cat >"$STATE_DIR/log4j.properties" <<'EOF'
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.request.logger=WARN
EOF
}

java_opts() {
    # shellcheck disable=SC2206  # KAFKA_HEAP is intentionally word-split
    JAVA_OPTS=($KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true
        -Dlog4j2.configurationFile="$STATE_DIR/log4j2.properties"
        -Dlog4j.configuration="file:$STATE_DIR/log4j.properties"
        -Dkafka.logs.dir="$STATE_DIR")
}

format_storage() {
    if [[ -f "$DATA_DIR/meta.properties" ]]; then
        return 0
    fi
    local tool cid="${1:-}"
    tool="$(<"$KAFKA_HOME/storage-tool")"
    [[ -n "$cid" ]] || cid="$(random_cluster_id)"
    log "formatting $DATA_DIR (cluster id $cid) with $tool"
    java_opts
    if ! "$JAVA" "${JAVA_OPTS[@]}" -cp "$LIBS_DIR/*" "$tool" format \
        -t "$cid" -c "$PROPS_FILE" --ignore-formatted \
        </dev/null >"$STATE_DIR/format.log" 2>&1; then
        tail -n 30 "$STATE_DIR/format.log" >&2
        die "storage format failed (see $STATE_DIR/format.log)"
    fi
}

# Serialise start/stop/reset of one state dir (e.g. parallel test runners).

# ------------------------------------------------------------- commands ----

cmd_start() {
    take_lock
    if is_running; then
        log "already running (pid $(running_pid))"
        if [[ -n "${KAFKA_PORT:-}" && "$KAFKA_PORT" != "$(<"$PORT_FILE")" ]]; then
            log "note: KAFKA_PORT=$KAFKA_PORT ignored; stop the running broker to change ports"
        fi
        bootstrap_addr
        return 0
    fi
    if running_pid >/dev/null; then
        log "pid $(running_pid) is alive but its port does not answer; restarting it"
        cmd_stop
    fi
    if [[ -f "$VERSION_FILE" && -f "$DATA_DIR/meta.properties" ]] \
        && [[ "$(<"$VERSION_FILE")" != "$KAFKA_VERSION" ]]; then
        log "note: $DATA_DIR was formatted by Kafka $(<"$VERSION_FILE"); run 'reset' if $KAFKA_VERSION refuses it"
    fi
    command -v "$JAVA" >/dev/null || die "java not found"
    cmd_fetch

    local port cport
    port="$(choose_port "${KAFKA_PORT:-}" "$PORT_FILE")"
    cport="$(choose_port "${KAFKA_CONTROLLER_PORT:-}" "$CPORT_FILE" "$port")"
    port_free "$port" || die "port $port on 127.0.0.1 is already in use"
    port_free "$cport" || die "controller port $cport on 127.0.0.1 is already in use"
    printf '%s\n' "$port" >"$PORT_FILE"
    printf '%s\n' "$cport" >"$CPORT_FILE"
    mkdir -p "$DATA_DIR"
    write_config "$port" "$cport"
    format_storage
    printf '%s\n' "$KAFKA_VERSION" >"$VERSION_FILE"

    launch_node "$port" "$cport"
    await_node "$(<"$PID_FILE")" "$port"
    bootstrap_addr
}

# start this node's JVM in the background (its pid into PID_FILE)
launch_node() {
    local port="$1" cport="$2"
    log "starting Kafka $KAFKA_VERSION node $((NODE_ID > 0 ? NODE_ID : 1)) on 127.0.0.1:$port (controller $cport), log $SERVER_LOG"
    java_opts
    if [[ -s "$SERVER_LOG" ]]; then
        mv -f "$SERVER_LOG" "$SERVER_LOG.prev"
    fi
    # 9>&-: the broker must not inherit (and so hold) the state-dir lock.
    nohup "$JAVA" "${JAVA_OPTS[@]}" -cp "$LIBS_DIR/*" kafka.Kafka "$PROPS_FILE" \
        </dev/null >>"$SERVER_LOG" 2>&1 9>&- &
    printf '%s\n' "$!" >"$PID_FILE"
}

# wait until this node serves on PORT, or fail with the end of its log
await_node() {
    local pid="$1" port="$2"
    local deadline=$((SECONDS + KAFKA_START_TIMEOUT))
    while :; do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PID_FILE"
            tail -n 40 "$SERVER_LOG" >&2
            die "Kafka exited during startup (log: $SERVER_LOG)"
        fi
        if grep -qE 'Kafka Server started|started \(kafka\.server\.Kafka' "$SERVER_LOG" \
            && port_answers "$port"; then
            break
        fi
        if ((SECONDS >= deadline)); then
            tail -n 40 "$SERVER_LOG" >&2
            log "error: Kafka did not come up within ${KAFKA_START_TIMEOUT}s; stopping pid $pid"
            cmd_stop >/dev/null 2>&1 || true
            exit 1
        fi
        sleep 0.5
    done
    log "Kafka $KAFKA_VERSION up (pid $pid)"
}

# ------------------------------------------------------------- cluster ----

# the cluster's ports, one "ID PORT CONTROLLER_PORT" line per node, chosen once and kept
# (the voters of every node's config name the controller ports)
CLUSTER_PORTS="$CLUSTER_DIR/ports"

cluster_ports() {
    if [[ ! -f "$CLUSTER_PORTS" ]]; then
        local i taken="" p c
        for ((i = 1; i <= KAFKA_BROKERS; i++)); do
            while :; do p="$(free_port)"; [[ " $taken " != *" $p "* ]] && break; done
            taken+=" $p"
            while :; do c="$(free_port)"; [[ " $taken " != *" $c "* ]] && break; done
            taken+=" $c"
            printf '%s %s %s\n' "$i" "$p" "$c"
        done >"$CLUSTER_PORTS.tmp"
        mv "$CLUSTER_PORTS.tmp" "$CLUSTER_PORTS"
    fi
    [[ "$(wc -l <"$CLUSTER_PORTS")" -eq "$KAFKA_BROKERS" ]] \
        || die "$CLUSTER_DIR holds a cluster of $(wc -l <"$CLUSTER_PORTS") nodes, not $KAFKA_BROKERS; run 'reset' first"
}

node_port() { awk -v n="$1" -v f="$2" '$1 == n { print $f }' "$CLUSTER_PORTS"; }

cluster_bootstrap() {
    awk '{ printf "%s127.0.0.1:%s", (NR > 1 ? "," : ""), $2 } END { print "" }' "$CLUSTER_PORTS"
}

cluster_start() {
    STATE_DIR="$CLUSTER_DIR"
    take_lock
    ((KAFKA_BROKERS >= 3)) || die "KAFKA_BROKERS must be 1 or at least 3 (a quorum that survives one loss), not $KAFKA_BROKERS"
    command -v "$JAVA" >/dev/null || die "java not found"
    cmd_fetch
    cluster_ports
    local cid voters="" i port cport rf=3 isr=2 started=()
    [[ -f "$CLUSTER_DIR/cluster.id" ]] || random_cluster_id >"$CLUSTER_DIR/cluster.id"
    cid="$(<"$CLUSTER_DIR/cluster.id")"
    for ((i = 1; i <= KAFKA_BROKERS; i++)); do
        voters+="${voters:+,}$i@127.0.0.1:$(node_port "$i" 3)"
    done
    for ((i = 1; i <= KAFKA_BROKERS; i++)); do
        select_node "$i"
        port="$(node_port "$i" 2)"
        cport="$(node_port "$i" 3)"
        if is_running; then
            continue
        fi
        if running_pid >/dev/null; then
            log "node $i: pid $(running_pid) is alive but its port does not answer; restarting it"
            cmd_stop
        fi
        port_free "$port" || die "node $i: port $port on 127.0.0.1 is in use by something else"
        port_free "$cport" || die "node $i: controller port $cport on 127.0.0.1 is in use by something else"
        mkdir -p "$DATA_DIR"
        printf '%s\n' "$port" >"$PORT_FILE"
        printf '%s\n' "$cport" >"$CPORT_FILE"
        write_config "$port" "$cport" "$voters" "$rf" "$isr"
        format_storage "$cid"
        printf '%s\n' "$KAFKA_VERSION" >"$VERSION_FILE"
        launch_node "$port" "$cport"
        started+=("$i")
    done
    # every node started first: a broker registers only once a quorum of controllers is up
    for i in "${started[@]}"; do
        select_node "$i"
        await_node "$(<"$PID_FILE")" "$(<"$PORT_FILE")"
    done
    cluster_bootstrap
}

cluster_stop() {
    local i pid pids=()
    for ((i = 1; i <= KAFKA_BROKERS; i++)); do
        select_node "$i"
        if pid="$(running_pid)"; then pids+=("$pid"); fi
    done
    # all at once: the last node of a quorum cannot shut down cleanly on its own
    STOP_TIMEOUT="$KAFKA_STOP_TIMEOUT" terminate "Kafka cluster" "${pids[@]}"
    for ((i = 1; i <= KAFKA_BROKERS; i++)); do
        select_node "$i"
        rm -f "$PID_FILE"
    done
    log "stopped"
}

cluster_status() {
    local i up=0
    [[ -f "$CLUSTER_PORTS" ]] || { printf 'not running\n'; return 3; }
    for ((i = 1; i <= KAFKA_BROKERS; i++)); do
        select_node "$i"
        if is_running; then
            printf 'node %s running %s (pid %s)\n' "$i" "$(bootstrap_addr)" "$(running_pid)"
            up=$((up + 1))
        else
            printf 'node %s not running\n' "$i"
        fi
    done
    ((up == KAFKA_BROKERS)) || return 3
}

cluster_kill() {
    local n="${1:-}" pid
    [[ "$n" =~ ^[0-9]+$ ]] && ((n >= 1 && n <= KAFKA_BROKERS)) || die "kill: a node id from 1 to $KAFKA_BROKERS, not '${n}'"
    select_node "$n"
    pid="$(running_pid)" || die "kill: node $n is not running"
    log "SIGKILL node $n (pid $pid)"
    kill -KILL "$pid"
    while pid_alive "$pid"; do sleep 0.1; done
}

cmd_stop() {
    local pid
    if ! pid="$(running_pid)"; then
        rm -f "$PID_FILE"
        log "not running"
        return 0
    fi
    STOP_TIMEOUT="$KAFKA_STOP_TIMEOUT" terminate Kafka "$pid"
    rm -f "$PID_FILE"
    log "stopped"
}

cmd_status() {
    if is_running; then
        printf 'running %s (pid %s, Kafka %s)\n' "$(bootstrap_addr)" "$(running_pid)" \
            "$(cat "$VERSION_FILE" 2>/dev/null || echo '?')"
        return 0
    fi
    printf 'not running\n'
    return 3
}

cmd_bootstrap() {
    if is_running; then
        bootstrap_addr
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
        rm -rf "$STATE_DIR"
    fi
}

main() {
    local cmd="${1:-help}"
    [[ "$KAFKA_BROKERS" =~ ^[0-9]+$ ]] && ((KAFKA_BROKERS >= 1)) || die "KAFKA_BROKERS must be a positive number, not '$KAFKA_BROKERS'"
    if ((KAFKA_BROKERS > 1)); then
        case "$cmd" in
            fetch) cmd_fetch ;;
            start) cluster_start ;;
            stop)
                STATE_DIR="$CLUSTER_DIR"
                take_lock
                cluster_stop
                ;;
            status) cluster_status ;;
            bootstrap)
                cluster_status >/dev/null || { log "not every node runs"; }
                [[ -f "$CLUSTER_PORTS" ]] || { log "not running"; return 3; }
                cluster_bootstrap
                ;;
            kill) cluster_kill "${2:-}" ;;
            reset)
                STATE_DIR="$CLUSTER_DIR"
                take_lock
                cluster_stop
                log "deleting $CLUSTER_DIR"
                rm -rf "$CLUSTER_DIR"
                ;;
            help | -h | --help) usage ;;
            *)
                usage >&2
                exit 2
                ;;
        esac
        return
    fi
    case "$cmd" in
        fetch) cmd_fetch ;;
        start) cmd_start ;;
        stop)
            take_lock
            cmd_stop
            ;;
        status) cmd_status ;;
        bootstrap) cmd_bootstrap ;;
        kill) die "kill: only for a cluster (KAFKA_BROKERS=3); use 'stop' for the single node" ;;
        reset) cmd_reset ;;
        help | -h | --help) usage ;;
        *)
            usage >&2
            exit 2
            ;;
    esac
}

main "$@"
