#!/usr/bin/env bash
# Runs the whole suite: starts the embedded Kafka broker, the local Slurm cluster and the
# local Kubernetes control plane in a private state dir, runs the layer contracts, unit
# and integration tests, and stops every service afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export FLEETMEDIC_STATE=${FLEETMEDIC_TEST_STATE:-${TMPDIR:-/tmp}/fleetmedic-test-$$}
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  bash deploy/k8s.sh stop >/dev/null 2>&1 || true
  bash deploy/slurm.sh stop >/dev/null 2>&1 || true
  bash deploy/kafka.sh stop >/dev/null 2>&1 || true
  bash deploy/monitoring.sh stop >/dev/null 2>&1 || true
  bash deploy/keycloak.sh stop >/dev/null 2>&1 || true
  rm -rf "$FLEETMEDIC_STATE"
}
trap cleanup EXIT
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
echo "== Prometheus, promtool and Alertmanager (built from the Go module proxy on first use and cached in"
echo "   ~/.cache/fleetmedic/monitoring; the tests start them)"
bash deploy/monitoring.sh build
echo "== Keycloak (the distribution from Maven Central on first use, cached in ~/.cache/fleetmedic/keycloak;"
echo "   the tests start it in dev mode with the realm of deploy/keycloak/realm.json)"
bash deploy/keycloak.sh fetch
echo "== Helm v4 (built from the Go module proxy on first use and cached in ~/.cache/fleetmedic/helm)"
bash deploy/helm.sh build
echo "== tests"
set +e
"$PY" -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
