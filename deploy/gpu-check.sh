#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and driver: read every GPU through NVML once with
# `fleetmedic collect --once --nvml on`, validate the record against the telemetry.gpu
# schema, and print what was read (fields present, fields the GPUs do not support).
# Exit status 0 when a valid record came back, 1 otherwise.
#
# Usage: deploy/gpu-check.sh [PYTHON]   (default: .venv/bin/python, else python3; it
#                                         needs fleetmedic's dependencies installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,temperature.gpu,power.draw --format=csv,noheader || true
else
    echo "gpu-check: nvidia-smi not found (checking NVML anyway)" >&2
fi
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
if ! "$PY" -m pipeline collect --once --nvml on --node "$(hostname)" --infiniband-root /nonexistent >"$out"; then
    echo "gpu-check: fleetmedic collect failed" >&2
    exit 1
fi
"$PY" - "$out" <<'PY'
import json, sys
from schemas import GpuSample
from schemas.records import PER_GPU_FIELDS

line = open(sys.argv[1]).readline()
rec = json.loads(line)
s = GpuSample.model_validate(rec)          # raises (exit 1) when the record is invalid
present = [f for f in PER_GPU_FIELDS if rec.get(f) is not None]
absent = [f for f in PER_GPU_FIELDS if f not in rec]
partial = [f for f in present if any(v is None for v in rec[f])]
print(f"gpu-check: valid telemetry.gpu record for {s.node}: {s.gpu_count} GPUs")
print(f"  fields read: {', '.join(present)}")
print(f"  not supported (absent): {', '.join(absent) or '-'}")
print(f"  supported by some GPUs only (null entries): {', '.join(partial) or '-'}")
print(f"  lost GPUs: {[i for i, v in enumerate(s.lost or []) if v] or '-'}; Xids pending: {len(s.xids)}")
print("  record: " + json.dumps({k: rec[k] for k in ("util", "temp", "power", "sm_clock") if k in rec}))
PY
