#!/usr/bin/env bash
# Runs the whole suite: starts the embedded Kafka broker, the local Slurm cluster and the
# local Kubernetes control plane in a private state dir, runs the layer contracts, unit
# and integration tests, and stops every service afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export FLEETMEDIC_STATE=${FLEETMEDIC_TEST_STATE:-${TMPDIR:-/tmp}/fleetmedic-test-$$}
# shellcheck disable=SC2317  # called by the EXIT trap
BUILDS_PID=
cleanup() {
  [ -n "$BUILDS_PID" ] && kill -- "-$BUILDS_PID" >/dev/null 2>&1 || true
  bash deploy/k8s.sh stop >/dev/null 2>&1 || true
  bash deploy/slurm.sh stop >/dev/null 2>&1 || true
  bash deploy/kafka.sh stop >/dev/null 2>&1 || true
  bash deploy/monitoring.sh stop >/dev/null 2>&1 || true
  bash deploy/keycloak.sh stop >/dev/null 2>&1 || true
  rm -rf "$FLEETMEDIC_STATE"
}
trap cleanup EXIT
mkdir -p "$FLEETMEDIC_STATE"
# What only the later tests need is built (or fetched) beside the checks and the control
# plane's build, each once and cached outside the checkout: on a cold machine the Go
# builds overlap their downloads and single-threaded links, and nothing waits for them
# until the tests start.
echo "== building Prometheus, promtool, Alertmanager and Helm v4 in the background (from the Go module proxy"
echo "   on first use, cached in ~/.cache/fleetmedic; log: $FLEETMEDIC_STATE/builds.log)"
# a process group of its own, so that an early exit stops the builds with it
setsid bash -c 'bash deploy/monitoring.sh build && bash deploy/helm.sh build' \
  >"$FLEETMEDIC_STATE/builds.log" 2>&1 </dev/null &
BUILDS_PID=$!
echo "== layer contracts"
.venv/bin/lint-imports
echo "== types (mypy --strict: detectors, schemas, actuators, pipeline/correlate, pipeline/actuate)"
"$PY" -m mypy
echo "== starting Kafka"
FLEETMEDIC_BOOTSTRAP=$(bash deploy/kafka.sh start | tail -n1)
export FLEETMEDIC_BOOTSTRAP
echo "Kafka at $FLEETMEDIC_BOOTSTRAP"
echo "== starting Slurm (slurmctld + 4 slurmd on loopback; installs slurm-wlm and munge if missing)"
FLEETMEDIC_SLURM_CONF=$(bash deploy/slurm.sh start | tail -n1 | sed 's/^SLURM_CONF=//')
export FLEETMEDIC_SLURM_CONF
echo "Slurm config $FLEETMEDIC_SLURM_CONF"
echo "== starting Kubernetes (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, Kueue and the"
echo "   Kubeflow training operator on loopback; built from the Go module proxy on first use and cached in"
echo "   ~/.cache/fleetmedic/k8s)"
FLEETMEDIC_KUBECONFIG=$(FLEETMEDIC_K8S_ADDONS=${FLEETMEDIC_K8S_ADDONS-kueue,training-operator} \
  bash deploy/k8s.sh start | tail -n1 | sed 's/^KUBECONFIG=//')
export FLEETMEDIC_KUBECONFIG
echo "Kubernetes admin kubeconfig $FLEETMEDIC_KUBECONFIG"
echo "== Keycloak (the distribution from Maven Central on first use, cached in ~/.cache/fleetmedic/keycloak;"
echo "   the tests start it in dev mode with the realm of deploy/keycloak/realm.json)"
bash deploy/keycloak.sh fetch
echo "== waiting for the background builds (Prometheus, Alertmanager, Helm; the tests start Prometheus and"
echo "   Alertmanager themselves)"
if ! wait "$BUILDS_PID"; then
  BUILDS_PID=
  tail -n 60 "$FLEETMEDIC_STATE/builds.log" >&2
  echo "a background build failed (its log is above)" >&2
  exit 1
fi
BUILDS_PID=
grep -E '^(monitoring|helm)\.sh: built' "$FLEETMEDIC_STATE/builds.log" || true
echo "== tests"
set +e
"$PY" -m pytest tests -q -p no:cacheprovider --durations=20 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
