# fleetmedic: the README's two commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
STAMP := $(VENV)/.installed


.PHONY: demo test bench bench-burst eval eval-nab eval-network eval-failures chaos unit integration lint schemas manifests kafka-start kafka-stop clean help

help:
	@echo "make demo   - install, start the embedded Kafka, a worker and the simulated cluster (ARGS=\"--duration 120 --seed 1\")"
	@echo "make test   - install, start Kafka, run unit + integration tests, stop Kafka"
	@echo "make manifests - the chart's values schema and deploy/kubernetes/fleetmedic.yaml (the chart rendered with its defaults)"
	@echo "make bench  - throughput/latency/scale-out/memory of a 10,000-node fleet (ARGS=--quick for a smoke run)"
	@echo "make bench-burst - 100/500/1,000 simultaneous hardware faults isolated on a real API server of 10,000 nodes, against the raw PATCH limit (bench/results/burst.json)"
	@echo "make eval   - detection quality (512 nodes, 300 faults, Kafka + Faust) and a 54-day closed loop vs three baselines (bench/results/eval.json)"
	@echo "make eval-nab - the univariate detector on the Numenta Anomaly Benchmark with a verified scorer (bench/results/nab.json)"
	@echo "make eval-failures - real failure output (tests/data/failures) through the job and node tracks (bench/results/failures.json)"
	@echo "make eval-network - the network track on 256 nodes / 8 leaf switches / 500 faults (bench/results/network.json)"
	@echo "make chaos  - 60 faults, 22 worker kills, 2 broker kills of 3, a 60 s backend outage, 100,000 fuzzed messages (bench/results/chaos.json)"
	@echo "make lint   - layer contracts (import-linter) and types (mypy --strict on the pyproject's files)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@$(PY) -m pipeline demo $(ARGS)

test: $(STAMP)
	@bash tests/run.sh

bench: $(STAMP)
	@$(PY) -m pipeline bench $(ARGS)

bench-burst: $(STAMP)
	@$(PY) -m pipeline bench-burst $(ARGS)

chaos: $(STAMP)
	@$(PY) -m pipeline chaos $(ARGS)

eval: $(STAMP)
	@$(PY) -m pipeline eval $(ARGS)

eval-nab: $(STAMP)
	@$(PY) -m pipeline eval-nab $(ARGS)

eval-failures: $(STAMP)
	@$(PY) -m pipeline eval-failures $(ARGS)

eval-network: $(STAMP)
	@$(PY) -m pipeline eval-network $(ARGS)

unit: $(STAMP)
	@$(PY) -m pytest tests/unit -q

lint: $(STAMP)
	@$(VENV)/bin/lint-imports
	@$(PY) -m mypy

schemas: $(STAMP)
	@$(PY) -m schemas.jsonschema

# the chart's values schema from the settings, and deploy/kubernetes/fleetmedic.yaml: the
# chart rendered with its defaults (Helm v4 is built once by deploy/helm.sh)
manifests: $(STAMP)
	@$(PY) -m pipeline chart-schema
	@{ echo "# Rendered from deploy/helm/fleetmedic with its default values by make manifests; do not edit."; \
	  echo "# Apply into the namespaces of namespace.yaml: kubectl apply --server-side -f deploy/kubernetes/"; \
	  bash deploy/helm.sh template fleetmedic deploy/helm/fleetmedic --namespace fleetmedic; } > deploy/kubernetes/fleetmedic.yaml.tmp
	@mv deploy/kubernetes/fleetmedic.yaml.tmp deploy/kubernetes/fleetmedic.yaml
	@echo "deploy/kubernetes/fleetmedic.yaml"

kafka-start:
	@bash deploy/kafka.sh start

kafka-stop:
	@bash deploy/kafka.sh stop

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
