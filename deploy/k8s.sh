#!/usr/bin/env bash
# Local Kubernetes control plane on loopback for tests and demos: etcd (Debian's
# etcd-server), kube-apiserver, kube-controller-manager and kube-scheduler built
# from the Go module proxy (k8s.io/kubernetes as a module, its staging modules
# replaced by their published versions) and cached outside the repository. No
# kubelet: tests register Node objects and play the kubelet by patching pod status.
#
# Usage: deploy/k8s.sh {build|start|stop|status|env|audit|reset|help}
set -euo pipefail

K8S_VERSION="${FLEETMEDIC_K8S_VERSION:-v1.36.3}"
CACHE_ROOT="${FLEETMEDIC_CACHE:-$HOME/.cache/fleetmedic}"
BUILD_DIR="$CACHE_ROOT/k8s/$K8S_VERSION"
BIN_DIR="$BUILD_DIR/bin"
STATE_ROOT="${FLEETMEDIC_STATE:-$HOME/.cache/fleetmedic/run}"
STATE_DIR="$STATE_ROOT/k8s"
PKI="$STATE_DIR/pki"
LOG_DIR="$STATE_DIR/log"
RUN_DIR="$STATE_DIR/run"
ETCD_DATA="$STATE_DIR/etcd"
PORTS_FILE="$STATE_DIR/ports"
KUBECONFIG_FILE="$STATE_DIR/admin.kubeconfig"
START_TIMEOUT="${FLEETMEDIC_K8S_START_TIMEOUT:-120}"
STOP_TIMEOUT="${FLEETMEDIC_K8S_STOP_TIMEOUT:-20}"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler)
# Add-ons run beside the control plane when named in FLEETMEDIC_K8S_ADDONS (comma or space
# separated): kueue, training-operator.  Each is built once from the Go module proxy.
KUEUE_VERSION="${FLEETMEDIC_KUEUE_VERSION:-v0.17.0}"
TRAINING_OPERATOR_VERSION="${FLEETMEDIC_TRAINING_OPERATOR_VERSION:-v1.8.1}"
ADDON_ROOT="$CACHE_ROOT/k8s/addons"
_addons="${FLEETMEDIC_K8S_ADDONS:-}"
read -r -a ADDONS <<<"${_addons//,/ }"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf 'k8s.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    cat <<EOF
Usage: deploy/k8s.sh COMMAND

A local Kubernetes $K8S_VERSION control plane on 127.0.0.1 for tests and demos:
etcd, kube-apiserver, kube-controller-manager and kube-scheduler. No kubelet.

Commands:
  build   build the three control-plane binaries with Go from the module proxy
          into $BIN_DIR (once per machine; prints the build time). Installs
          Debian's etcd-server if etcd is missing.
  start   build if needed, generate a CA, serving certificate, service-account
          key and an admin kubeconfig, start etcd, the API server, the
          controller manager and the scheduler on free loopback ports, and wait
          until /readyz answers. Prints KUBECONFIG=<path> as the last line of
          stdout. Idempotent: if this state dir's control plane runs, just
          prints the line.
  stop    SIGTERM the four processes (SIGKILL after ${STOP_TIMEOUT}s). Idempotent.
  status  "running KUBECONFIG=<path>" (exit 0) or "not running" (exit 3)
  env     print KUBECONFIG=<path> of the running control plane (exit 3 if none)
  audit   print the path of the API server's audit log (JSON lines: every
          create, update, patch and delete of nodes, pods, evictions and Jobs,
          with its request body and answer; reads are not logged)
  reset   stop and delete the state dir (etcd data, keys, logs)
  help    this text

Add-ons (FLEETMEDIC_K8S_ADDONS="kueue,training-operator"): built with "go install" from
the Go module proxy into $ADDON_ROOT, their CRDs applied as they ship,
and their controllers run on loopback with the admin's rights:
  kueue              sigs.k8s.io/kueue $KUEUE_VERSION (batch/job and kubeflow.org/pytorchjob
                     integrations; its webhooks called on 127.0.0.1 with a certificate of
                     this CA; no visibility API server)
  training-operator  github.com/kubeflow/training-operator $TRAINING_OPERATOR_VERSION
                     (PyTorchJob only; its validating webhook is registered selecting no
                     object: its certificate names an in-cluster Service that a loopback
                     URL cannot match)

Environment:
  FLEETMEDIC_K8S_VERSION        Kubernetes release to build (default v1.36.3)
  FLEETMEDIC_K8S_ADDONS         add-ons to build and run beside it (default none)
  FLEETMEDIC_KUEUE_VERSION      Kueue release (default v0.17.0)
  FLEETMEDIC_TRAINING_OPERATOR_VERSION  training operator release (default v1.8.1)
  FLEETMEDIC_PYTHON             Python with PyYAML for the manifests (default: the
                                repository's .venv, else python3)
  FLEETMEDIC_CACHE              build cache root (default \$HOME/.cache/fleetmedic)
  FLEETMEDIC_STATE              state root (default \$HOME/.cache/fleetmedic/run);
                                the control plane lives in \$FLEETMEDIC_STATE/k8s
  FLEETMEDIC_K8S_START_TIMEOUT  s to wait for readiness (default 120)
EOF
}

etcd_bin() {
    local b
    for b in etcd /usr/bin/etcd /usr/sbin/etcd; do
        command -v "$b" >/dev/null 2>&1 && { command -v "$b"; return 0; }
    done
    return 1
}

ensure_etcd() {
    etcd_bin >/dev/null && return 0
    log "etcd missing: installing Debian's etcd-server with apt-get ..."
    apt_install etcd-server
    # The package may start a system etcd on 2379; ours uses its own ports.
    etcd_bin >/dev/null || die "etcd still missing after installing etcd-server"
}

# ------------------------------------------------------------------ build ---

built() {
    local c
    for c in "${COMPONENTS[@]}"; do [[ -x "$BIN_DIR/$c" ]] || return 1; done
}

cmd_build() {
    local a
    for a in "${ADDONS[@]}"; do build_addon "$a"; done
    if built; then
        log "control-plane binaries for $K8S_VERSION cached in $BIN_DIR"
        return 0
    fi
    command -v go >/dev/null || die "go is needed to build the control plane"
    mkdir -p "$BUILD_DIR/src"
    exec 8>"$BUILD_DIR/.build.lock"
    command -v flock >/dev/null && { flock -w 3600 8 || die "build lock held for an hour"; }
    if built; then return 0; fi
    local start=$SECONDS minor src="$BUILD_DIR/src" modfile staging=()
    minor="${K8S_VERSION#v1.}"
    minor="${minor%%.*}"
    log "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION from the Go module proxy (once per machine; 10-30 min on 2 cores) ..."
    export GOFLAGS=-mod=mod
    modfile="$(cd "$src" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    mapfile -t staging < <(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$modfile")
    ((${#staging[@]} > 10)) || die "no staging replace lines found in $modfile"
    {
        printf 'module fleetmedic.local/k8s-build\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' \
            "$(sed -n 's/^go \([0-9.]*\).*/\1/p' "$modfile")" "$K8S_VERSION"
        local m
        for m in "${staging[@]}"; do printf '\t%s => %s v0.%s\n' "$m" "$m" "${K8S_VERSION#v1.}"; done
        printf ')\n'
    } >"$src/go.mod"
    cat >"$src/tools.go" <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
EOF
    (cd "$src" && go mod tidy >&2) || die "go mod tidy failed in $src"
    local ldflags="-s -w"
    local pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    mkdir -p "$BIN_DIR.tmp"
    local c
    for c in "${COMPONENTS[@]}"; do
        log "go build $c ..."
        (cd "$src" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$BIN_DIR.tmp/$c" "k8s.io/kubernetes/cmd/$c") ||
            die "go build $c failed"
    done
    rm -rf "$BIN_DIR"
    mv "$BIN_DIR.tmp" "$BIN_DIR"
    log "built $K8S_VERSION control plane in $((SECONDS - start)) s ($BIN_DIR)"
}

# ---------------------------------------------------------------- add-ons ---

has_addon() { local a; for a in "${ADDONS[@]}"; do [[ "$a" == "$1" ]] && return 0; done; return 1; }

addon_dir() {
    case "$1" in
    kueue) printf '%s/kueue-%s\n' "$ADDON_ROOT" "$KUEUE_VERSION" ;;
    training-operator) printf '%s/training-operator-%s\n' "$ADDON_ROOT" "$TRAINING_OPERATOR_VERSION" ;;
    *) die "unknown add-on $1 (known: kueue, training-operator)" ;;
    esac
}

python_bin() {
    if [[ -n "${FLEETMEDIC_PYTHON:-}" ]]; then printf '%s\n' "$FLEETMEDIC_PYTHON"
    elif [[ -x "$REPO_DIR/.venv/bin/python" ]]; then printf '%s\n' "$REPO_DIR/.venv/bin/python"
    else command -v python3; fi
}

# build add-on NAME: go install its command at its version; keep its CRDs (and Kueue's
# webhook manifest) beside the binary, taken from the same module
build_addon() {
    local name="$1" dir module version pkg
    dir="$(addon_dir "$name")"
    [[ -x "$dir/bin/$name" ]] && return 0
    case "$name" in
    kueue) module=sigs.k8s.io/kueue version=$KUEUE_VERSION pkg=sigs.k8s.io/kueue/cmd/kueue ;;
    training-operator)
        module=github.com/kubeflow/training-operator version=$TRAINING_OPERATOR_VERSION
        pkg=github.com/kubeflow/training-operator/cmd/training-operator.v1 ;;
    esac
    command -v go >/dev/null || die "go is needed to build $name"
    mkdir -p "$ADDON_ROOT"
    exec 7>"$ADDON_ROOT/.build-$name.lock"
    command -v flock >/dev/null && { flock -w 3600 7 || die "build lock of $name held for an hour"; }
    [[ -x "$dir/bin/$name" ]] && return 0
    local start=$SECONDS src tmp="$dir.tmp"
    log "building $name $version from the Go module proxy (once per machine; 10-20 min on 2 cores) ..."
    src="$(cd "$ADDON_ROOT" && GOFLAGS=-mod=mod go mod download -json "$module@$version" |
        "$(python_bin)" -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')" ||
        die "the Go module proxy did not serve $module@$version"
    rm -rf "$tmp"
    mkdir -p "$tmp/bin" "$tmp/crds"
    (cd "$ADDON_ROOT" && GOBIN="$tmp/bin" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "$pkg@$version") ||
        die "go install $pkg@$version failed"
    mv "$tmp/bin/$(basename "$pkg")" "$tmp/bin/$name.new" && mv "$tmp/bin/$name.new" "$tmp/bin/$name"
    case "$name" in
    kueue)
        cp "$src"/config/components/crd/bases/*.yaml "$tmp/crds/"
        mkdir -p "$tmp/webhook"
        cp "$src/config/components/webhook/manifests.yaml" "$tmp/webhook/" ;;
    training-operator)
        cp "$src/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" "$tmp/crds/"
        mkdir -p "$tmp/webhook"
        cp "$src/manifests/base/webhook/manifests.yaml" "$tmp/webhook/" ;;
    esac
    chmod -R u+w "$tmp"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    log "built $name $version in $((SECONDS - start)) s ($dir)"
}

# apply the objects `deploy/k8s_objects.py ARGS...` prints (server-side apply, as
# kubectl apply --server-side does)
apply_objects() {
    local path obj lines
    lines="$("$(python_bin)" "$REPO_DIR/deploy/k8s_objects.py" "$@")" || die "k8s_objects.py $* failed"
    while IFS=$'\t' read -r path obj; do
        [[ -n "$path" ]] || continue
        printf '%s' "$obj" | api_apply "$path" || die "could not apply $path"
    done <<<"$lines"
}

api_apply() {
    curl -sf --max-time 60 --cacert "$PKI/ca.crt" -H "Authorization: Bearer $(token_of admin)" \
        -X PATCH -H 'Content-Type: application/apply-patch+yaml' --data-binary @- -o /dev/null \
        "https://127.0.0.1:$(port_of kube-apiserver)$1?fieldManager=fleetmedic-deploy&force=true"
}

ensure_namespace() {
    printf '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"%s"}}' "$1" | api_apply "/api/v1/namespaces/$1"
}

# a token for add-on NAME, in the system:masters group (a local control plane for tests)
ensure_token() {
    grep -q ",$1,uid-$1," "$PKI/tokens.csv" && return 0
    printf '%s,%s,uid-%s,"system:masters"\n' "$(openssl rand -hex 24)" "$1" "$1" >>"$PKI/tokens.csv"
}

api_served() { api_get "$1" >/dev/null 2>&1; }

# true once every served version of the CRDs in FILES is in the API server's discovery
# (a group is served as soon as one of its CRDs is; a controller that maps all its kinds
# at start fails on one that is not established yet)
crds_established() {
    local gv plural doc
    while read -r gv plural; do
        [[ -n "$gv" ]] || continue
        doc="$(api_get "/apis/$gv" 2>/dev/null)" || return 1
        grep -Eq "\"name\": ?\"$plural\"" <<<"$doc" || return 1
    done < <("$(python_bin)" "$REPO_DIR/deploy/k8s_objects.py" crd-resources "$@")
}

probe_ready() { curl -sf --max-time 5 "http://127.0.0.1:$(port_of "$1")/readyz" >/dev/null; }

write_kueue_config() {
    local certs="$1"
    {
        printf 'apiVersion: config.kueue.x-k8s.io/v1beta2\nkind: Configuration\nnamespace: kueue-system\n'
        printf 'health:\n  healthProbeBindAddress: 127.0.0.1:%s\n' "$(port_of kueue-health)"
        printf 'metrics:\n  bindAddress: "0"\n'
        printf 'webhook:\n  host: 127.0.0.1\n  port: %s\n  certDir: %s\n' "$(port_of kueue-webhook)" "$certs"
        printf 'leaderElection:\n  leaderElect: false\n'
        printf 'internalCertManagement:\n  enable: false\n'
        printf 'featureGates:\n  VisibilityOnDemand: false\n'
        printf 'manageJobsWithoutQueueName: false\n'
        printf 'integrations:\n  frameworks:\n  - batch/job\n  - kubeflow.org/pytorchjob\n'
    } >"$STATE_DIR/kueue-config.yaml"
}

start_kueue() {
    local dir certs="$STATE_DIR/kueue-certs" deadline="$1"
    dir="$(addon_dir kueue)"
    mkdir -p "$certs"
    if [[ ! -s "$certs/tls.crt" ]]; then
        printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n' \
            >"$certs/ext"
        openssl req -newkey rsa:2048 -nodes -keyout "$certs/tls.key" -out "$certs/tls.csr" \
            -subj "/CN=kueue-webhook" 2>/dev/null
        openssl x509 -req -in "$certs/tls.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
            -out "$certs/tls.crt" -days 3650 -extfile "$certs/ext" 2>/dev/null
        chmod 0600 "$certs/tls.key"
    fi
    # Kueue without its own certificate management reads a metrics certificate from this
    # fixed path at start, even with metrics off; any valid pair will do
    if [[ ! -s /etc/kueue/metrics/certs/tls.crt ]]; then
        need_root_cmd mkdir -p /etc/kueue/metrics/certs
        need_root_cmd install -m 0644 "$certs/tls.crt" /etc/kueue/metrics/certs/tls.crt
        need_root_cmd install -m 0600 "$certs/tls.key" /etc/kueue/metrics/certs/tls.key
    fi
    ensure_namespace kueue-system
    apply_objects crds "$dir"/crds/*.yaml
    wait_for "Kueue's CRDs" "$deadline" crds_established "$dir"/crds/*.yaml
    write_kueue_config "$certs"
    write_kubeconfig "$STATE_DIR/kueue.kubeconfig" kueue
    log "starting Kueue $KUEUE_VERSION (webhooks on https://127.0.0.1:$(port_of kueue-webhook))"
    spawn kueue env KUBECONFIG="$STATE_DIR/kueue.kubeconfig" "$dir/bin/kueue" \
        --config="$STATE_DIR/kueue-config.yaml" --zap-log-level=info
    wait_for Kueue "$deadline" probe_ready kueue-health
    apply_objects webhooks "$dir/webhook/manifests.yaml" --url "https://127.0.0.1:$(port_of kueue-webhook)" \
        --ca "$PKI/ca.crt" --prefix kueue- --keep 'batch/jobs,kubeflow.org/pytorchjobs,kueue.x-k8s.io/*'
}

start_training_operator() {
    local dir deadline="$1"
    dir="$(addon_dir training-operator)"
    ensure_namespace kubeflow
    # the operator's certificate rotator keeps its serving certificate in this Secret
    printf '{"apiVersion":"v1","kind":"Secret","metadata":{"name":"training-operator-webhook-cert","namespace":"kubeflow"}}' |
        api_apply /api/v1/namespaces/kubeflow/secrets/training-operator-webhook-cert
    apply_objects crds "$dir"/crds/*.yaml
    wait_for "the PyTorchJob CRD" "$deadline" crds_established "$dir"/crds/*.yaml
    # its certificate rotator starts the controllers only once it has injected its CA into
    # this configuration: registered, selecting no object (see deploy/k8s_objects.py)
    apply_objects webhooks "$dir/webhook/manifests.yaml" --url "https://127.0.0.1:$(port_of training-operator-webhook)" \
        --ca "$PKI/ca.crt" --name validator.training-operator.kubeflow.org --keep kubeflow.org/pytorchjobs --inert
    write_kubeconfig "$STATE_DIR/training-operator.kubeconfig" training-operator
    log "starting the training operator $TRAINING_OPERATOR_VERSION (PyTorchJob)"
    # --kubeconfig (controller-runtime's flag) also puts the state dir on its command line,
    # which is how stop knows the process is this control plane's (deploy/lib.sh live_pid)
    spawn training-operator env KUBECONFIG="$STATE_DIR/training-operator.kubeconfig" MY_POD_NAMESPACE=kubeflow \
        "$dir/bin/training-operator" --kubeconfig="$STATE_DIR/training-operator.kubeconfig" \
        --enable-scheme=pytorchjob --leader-elect=false \
        --metrics-bind-address=0 --health-probe-bind-address="127.0.0.1:$(port_of training-operator-health)" \
        --webhook-server-port="$(port_of training-operator-webhook)"
    # the kubelet's part: the rotator writes its certificate into the Secret and waits to
    # find it mounted in its (fixed) certificate directory
    wait_for "the training operator's certificate" "$deadline" mount_operator_certs
    wait_for "the training operator" "$deadline" probe_ready training-operator-health
}

OPERATOR_CERT_DIR=/tmp/k8s-webhook-server/serving-certs

# write the data of the operator's certificate Secret as files, as a secret volume
# would (false until the rotator has filled it)
mount_operator_certs() {
    local doc
    doc="$(api_get /api/v1/namespaces/kubeflow/secrets/training-operator-webhook-cert 2>/dev/null)" || return 1
    printf '%s' "$doc" | "$(python_bin)" -c '
import base64, json, os, sys
data = json.load(sys.stdin).get("data") or {}
if "tls.crt" not in data or "tls.key" not in data:
    sys.exit(1)
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for k, v in data.items():
    tmp = os.path.join(d, "." + k)
    with open(tmp, "wb") as f:
        f.write(base64.b64decode(v))
    os.chmod(tmp, 0o600)
    os.replace(tmp, os.path.join(d, k))
' "$OPERATOR_CERT_DIR"
}

# ----------------------------------------------------------------- ports ---

port_of() { awk -v n="$1" '$1 == n { print $2 }' "$PORTS_FILE"; }

choose_ports() {
    local n p taken=" "
    : >"$PORTS_FILE.new"
    for n in etcd etcd-peer kube-apiserver kube-controller-manager kube-scheduler kueue-webhook kueue-health \
        training-operator-webhook training-operator-health; do
        while :; do
            p="$(free_port)"
            [[ "$taken" != *" $p "* ]] && break
        done
        taken+="$p "
        printf '%s %s\n' "$n" "$p" >>"$PORTS_FILE.new"
    done
    mv -f "$PORTS_FILE.new" "$PORTS_FILE"
}

# --------------------------------------------------------------- processes ---

# pid of component NAME from its pid file if alive and started for this state dir
component_pid() { live_pid "$RUN_DIR/$1.pid" "$STATE_DIR"; }

# start NAME ARGS... in the background, detached, logging to log/NAME.log
spawn() {
    local name="$1"
    shift
    [[ -s "$LOG_DIR/$name.log" ]] && mv -f "$LOG_DIR/$name.log" "$LOG_DIR/$name.log.prev"
    # 9>&-: no daemon may hold the state-dir lock; nohup (as deploy/kafka.sh does): $! is
    # the daemon itself, and a hangup of the starting shell does not reach it
    nohup "$@" </dev/null >"$LOG_DIR/$name.log" 2>&1 9>&- &
    printf '%s\n' "$!" >"$RUN_DIR/$name.pid"
}

# stop components NAMES... (those still running)
stop_components() {
    local name pid pids=() names=()
    for name in "$@"; do
        if pid="$(component_pid "$name")"; then
            pids+=("$pid")
            names+=("$name")
        fi
    done
    terminate "${names[*]:-nothing}" "${pids[@]}"
}

show_logs() {
    local f
    for f in "$LOG_DIR"/*.log; do
        [[ -s "$f" ]] || continue
        printf '==> %s <==\n' "$f" >&2
        tail -n 20 "$f" >&2
    done
}

# ----------------------------------------------------------------- audit ---

# The API server's own record of every change made to nodes, pods, evictions and Jobs:
# the ground truth of `make chaos` against this control plane (pipeline/eval/audit.py).
# Reads are not logged; each change is logged once it is answered, with its request body
# (node status too: the quarantine condition is part of an isolation).
AUDIT_POLICY="$STATE_DIR/audit-policy.yaml"
AUDIT_LOG="$LOG_DIR/audit.log"

write_audit_policy() {
    cat > "$AUDIT_POLICY" <<'YAML'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
  - level: None
    verbs: ["get", "list", "watch"]
  # a pod's name may come from generateName: its answer has it
  - level: RequestResponse
    verbs: ["create"]
    resources:
      - group: ""
        resources: ["pods"]
  - level: Request
    verbs: ["create", "update", "patch", "delete"]
    resources:
      - group: ""
        resources: ["nodes", "nodes/status", "pods", "pods/eviction", "pods/binding"]
      - group: "batch"
        resources: ["jobs"]
  - level: None
YAML
}

# ------------------------------------------------------------------- pki ---

gen_pki() {
    mkdir -p "$PKI"
    chmod 0700 "$PKI"
    [[ -s "$PKI/ca.crt" && -s "$PKI/apiserver.crt" && -s "$PKI/sa.key" && -s "$PKI/tokens.csv" ]] && return 0
    log "generating CA, serving certificate, service-account key and tokens in $PKI"
    (
        cd "$PKI"
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 \
            -subj "/CN=fleetmedic-local-ca" 2>/dev/null
        cat >apiserver.ext <<'EOF'
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
        openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
            -subj "/CN=kube-apiserver" 2>/dev/null
        openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
            -out apiserver.crt -days 3650 -extfile apiserver.ext 2>/dev/null
        openssl genrsa -out sa.key 2048 2>/dev/null
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
        local t
        {
            t="$(openssl rand -hex 24)"; printf '%s,admin,uid-admin,"system:masters"\n' "$t"
            t="$(openssl rand -hex 24)"; printf '%s,system:kube-controller-manager,uid-kcm\n' "$t"
            t="$(openssl rand -hex 24)"; printf '%s,system:kube-scheduler,uid-sched\n' "$t"
        } >tokens.csv
        chmod 0600 ./*.key tokens.csv
    )
}

token_of() { awk -F, -v u="$1" '$2 == u { print $1 }' "$PKI/tokens.csv"; }

write_kubeconfig() {
    local file="$1" user="$2" server
    server="https://127.0.0.1:$(port_of kube-apiserver)"
    cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: fleetmedic-local
  cluster:
    server: $server
    certificate-authority: $PKI/ca.crt
users:
- name: $user
  user:
    token: $(token_of "$user")
contexts:
- name: fleetmedic-local
  context:
    cluster: fleetmedic-local
    user: $user
current-context: fleetmedic-local
EOF
    chmod 0600 "$file"
}

# ------------------------------------------------------------- readiness ---

api_get() {
    curl -sf --max-time 5 --cacert "$PKI/ca.crt" -H "Authorization: Bearer $(token_of admin)" \
        "https://127.0.0.1:$(port_of kube-apiserver)$1"
}

default_sa() { api_get /api/v1/namespaces/default/serviceaccounts/default >/dev/null 2>&1; }

api_ready() { [[ "$(api_get /readyz 2>/dev/null)" == ok ]]; }

healthz() { curl -skf --max-time 5 "https://127.0.0.1:$(port_of "$1")/healthz" >/dev/null; }

is_running() {
    local c
    component_pid etcd >/dev/null || return 1
    for c in "${COMPONENTS[@]}" "${ADDONS[@]}"; do component_pid "$c" >/dev/null || return 1; done
    [[ -f "$KUBECONFIG_FILE" ]] && api_ready
}

wait_for() {
    local what="$1" deadline="$2"
    shift 2
    until "$@"; do
        if ((SECONDS >= deadline)); then
            show_logs
            die "$what not ready within ${START_TIMEOUT}s (logs in $LOG_DIR)"
        fi
        local name pid
        for name in etcd "${COMPONENTS[@]}" "${ADDONS[@]}"; do
            [[ -f "$RUN_DIR/$name.pid" ]] || continue
            # the bare pid, not component_pid: until nohup has exec'd, the child's command
            # line is still this script's, and a busy machine must not read that as an exit
            pid="$(file_pid "$RUN_DIR/$name.pid")"
            if [[ -z "$pid" ]] || ! pid_alive "$pid"; then
                show_logs
                die "$name exited during start (log $LOG_DIR/$name.log)"
            fi
        done
        sleep 0.5
    done
}

kubeconfig_line() { printf 'KUBECONFIG=%s\n' "$KUBECONFIG_FILE"; }

# -------------------------------------------------------------- commands ---

cmd_start() {
    take_lock
    if is_running; then
        log "already running (kube-apiserver pid $(component_pid kube-apiserver))"
        kubeconfig_line
        return 0
    fi
    cmd_build
    ensure_etcd
    if [[ -n "$(ls "$RUN_DIR"/*.pid 2>/dev/null)" ]]; then
        log "partly running; stopping the leftovers first"
        do_stop
    fi
    local start=$SECONDS deadline=$((SECONDS + START_TIMEOUT))
    mkdir -p "$LOG_DIR" "$RUN_DIR" "$ETCD_DATA"
    chmod 0700 "$ETCD_DATA"
    gen_pki
    local a
    for a in "${ADDONS[@]}"; do ensure_token "$a"; done  # read by the API server at its start
    write_audit_policy
    choose_ports
    write_kubeconfig "$KUBECONFIG_FILE" admin
    write_kubeconfig "$STATE_DIR/controller-manager.kubeconfig" system:kube-controller-manager
    write_kubeconfig "$STATE_DIR/scheduler.kubeconfig" system:kube-scheduler
    local etcd_url peer_url
    etcd_url="http://127.0.0.1:$(port_of etcd)"
    peer_url="http://127.0.0.1:$(port_of etcd-peer)"

    log "starting etcd on $etcd_url"
    spawn etcd "$(etcd_bin)" --name fleetmedic --data-dir "$ETCD_DATA" \
        --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
        --listen-peer-urls "$peer_url" --initial-advertise-peer-urls "$peer_url" \
        --initial-cluster "fleetmedic=$peer_url" --initial-cluster-state new \
        --log-level warn --logger zap --quota-backend-bytes 4294967296
    wait_for etcd "$deadline" curl -sf --max-time 2 "$etcd_url/health" -o /dev/null

    log "starting kube-apiserver on https://127.0.0.1:$(port_of kube-apiserver)"
    spawn kube-apiserver "$BIN_DIR/kube-apiserver" \
        --etcd-servers="$etcd_url" --etcd-prefix=/registry \
        --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$(port_of kube-apiserver)" \
        --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
        --client-ca-file="$PKI/ca.crt" --token-auth-file="$PKI/tokens.csv" \
        --authorization-mode=Node,RBAC \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
        --service-cluster-ip-range=10.0.0.0/24 --endpoint-reconciler-type=none \
        --audit-policy-file="$AUDIT_POLICY" --audit-log-path="$AUDIT_LOG" --audit-log-format=json \
        --audit-log-maxsize=256 --audit-log-maxbackup=2 \
        --profiling=false --v=1 --cert-dir="$PKI/serving"
    wait_for kube-apiserver "$deadline" api_ready

    log "starting kube-controller-manager and kube-scheduler"
    # Without kubelets, two node controllers only get in the way: node-lifecycle would
    # taint every node NotReady, and ttl would re-annotate every node each time the
    # cluster's size crosses one of its thresholds (10,000 patches for make bench-burst).
    spawn kube-controller-manager "$BIN_DIR/kube-controller-manager" \
        --kubeconfig="$STATE_DIR/controller-manager.kubeconfig" \
        --authentication-kubeconfig="$STATE_DIR/controller-manager.kubeconfig" \
        --authorization-kubeconfig="$STATE_DIR/controller-manager.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port="$(port_of kube-controller-manager)" \
        --leader-elect=false --use-service-account-credentials=true \
        --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
        --controllers='*,-node-lifecycle-controller,-ttl-controller' --cert-dir="$PKI/kcm" \
        --profiling=false --v=1
    spawn kube-scheduler "$BIN_DIR/kube-scheduler" \
        --kubeconfig="$STATE_DIR/scheduler.kubeconfig" \
        --authentication-kubeconfig="$STATE_DIR/scheduler.kubeconfig" \
        --authorization-kubeconfig="$STATE_DIR/scheduler.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port="$(port_of kube-scheduler)" \
        --leader-elect=false --cert-dir="$PKI/sched" --profiling=false --v=1
    wait_for kube-controller-manager "$deadline" healthz kube-controller-manager
    wait_for kube-scheduler "$deadline" healthz kube-scheduler
    # the namespace controller's default ServiceAccount: pods can be created from here on
    wait_for "default ServiceAccount" "$deadline" default_sa
    has_addon training-operator && start_training_operator "$deadline"
    has_addon kueue && start_kueue "$deadline"
    log "control plane ready in $((SECONDS - start)) s (logs in $LOG_DIR)"
    kubeconfig_line
}

do_stop() {
    stop_components kueue training-operator
    stop_components kube-scheduler kube-controller-manager kube-apiserver
    stop_components etcd
    rm -f "$RUN_DIR"/*.pid
}

cmd_stop() {
    take_lock
    do_stop
}

cmd_status() {
    if is_running; then
        printf 'running '
        kubeconfig_line
        return 0
    fi
    echo "not running"
    return 3
}

cmd_env() {
    is_running || { log "not running"; return 3; }
    kubeconfig_line
}

cmd_reset() {
    take_lock
    do_stop
    rm -rf "$STATE_DIR"
    log "removed $STATE_DIR"
}

# ------------------------------------------------------------------- main ---

main() {
    local cmd="${1:-help}"
    case "$cmd" in
    build) cmd_build ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    reset) cmd_reset ;;
    audit) printf '%s\n' "$AUDIT_LOG" ;;
    help | -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
    esac
}

main "$@"
