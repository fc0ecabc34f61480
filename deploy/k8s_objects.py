"""Turn upstream manifests into the objects deploy/k8s.sh applies: one line per object, its
API path, a tab, and the object as JSON.

Used by ``deploy/k8s.sh`` for the add-ons it runs beside the local control plane (Kueue,
the Kubeflow training operator): their CustomResourceDefinitions as they ship, and
Kueue's webhook configurations pointed at the controller's loopback address.

    python deploy/k8s_objects.py crds FILE...
    python deploy/k8s_objects.py webhooks MANIFEST --url https://127.0.0.1:PORT --ca CA.crt \\
        --prefix kueue- --keep batch/jobs,kubeflow.org/pytorchjobs,kueue.x-k8s.io/*

``webhooks`` keeps only the webhooks whose rules touch the kept resources (the others
would call a controller for kinds this control plane does not serve), replaces each
``clientConfig.service`` by ``url`` plus the service's path with the CA bundle (there is
no cluster network: the API server calls the controller on loopback), prefixes the
configurations' names, and gives the webhooks of workload kinds an ``objectSelector`` on
Kueue's queue-name label, so that the Jobs of everything else (fleetmedic's diagnostics
Jobs among them) never wait on Kueue.  ``--inert`` registers a configuration that selects
no object: the training operator's certificate rotator will not start its controllers
until its configuration exists, and its certificate names an in-cluster Service that a
loopback URL cannot match.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any

import yaml

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: the workload kinds whose webhooks only jobs submitted to a queue need
WORKLOAD_RESOURCES = frozenset({"jobs", "pytorchjobs"})


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def _kept(rule: dict[str, Any], keep: set[tuple[str, str]]) -> bool:
    return any((g, r) in keep or (g, "*") in keep
               for g in rule.get("apiGroups") or [] for r in rule.get("resources") or [])


#: a label no object carries: a webhook selecting it is registered but never called
INERT_LABEL = "fleetmedic.io/webhook-not-reachable"


def webhooks(manifest: Path, url: str, ca: bytes, prefix: str, keep: set[tuple[str, str]], *,
             name: str | None = None, inert: bool = False) -> list[dict[str, Any]]:
    out = []
    for cfg in docs(manifest):
        hooks = []
        for h in cfg.get("webhooks") or []:
            rules = h.get("rules") or []
            if not rules or not all(_kept(r, keep) for r in rules):
                continue
            path = ((h.get("clientConfig") or {}).get("service") or {}).get("path") or ""
            h["clientConfig"] = {"url": url.rstrip("/") + path, "caBundle": base64.b64encode(ca).decode()}
            if inert:
                h["objectSelector"] = {"matchExpressions": [{"key": INERT_LABEL, "operator": "Exists"}]}
            elif any(set(r.get("resources") or []) & WORKLOAD_RESOURCES for r in rules):
                h["objectSelector"] = {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
            hooks.append(h)
        if hooks:
            cfg["metadata"] = {"name": name or prefix + cfg["metadata"]["name"]}
            cfg["webhooks"] = hooks
            out.append(cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("crds", help="the CustomResourceDefinitions in FILEs")
    c.add_argument("files", nargs="+", type=Path)
    r = sub.add_parser("crd-resources", help="'<group>/<version> <plural>' of every served version of the CRDs")
    r.add_argument("files", nargs="+", type=Path)
    w = sub.add_parser("webhooks", help="webhook configurations pointed at a loopback URL")
    w.add_argument("manifest", type=Path)
    w.add_argument("--url", required=True)
    w.add_argument("--ca", required=True, type=Path)
    w.add_argument("--prefix", default="")
    w.add_argument("--keep", required=True, help="group/resource,... (resource * for a whole group)")
    w.add_argument("--name", help="the configuration's name (default: --prefix + its own)")
    w.add_argument("--inert", action="store_true",
                   help=f"select no object (label {INERT_LABEL}): registered for a controller that requires its "
                        "configuration to exist, never called")
    a = p.parse_args(argv)
    if a.cmd == "crd-resources":
        for f in a.files:
            for d in docs(f):
                if d.get("kind") == "CustomResourceDefinition":
                    spec = d["spec"]
                    for v in spec.get("versions") or []:
                        if v.get("served"):
                            print(f"{spec['group']}/{v['name']} {spec['names']['plural']}")
        return 0
    if a.cmd == "crds":
        objs = [d for f in a.files for d in docs(f) if d.get("kind") == "CustomResourceDefinition"]
    else:
        keep = {tuple(x.split("/", 1)) for x in a.keep.split(",") if "/" in x}
        objs = webhooks(a.manifest, a.url, a.ca.read_bytes(), a.prefix, keep,  # type: ignore[arg-type]
                        name=a.name, inert=a.inert)
    for o in objs:
        sys.stdout.write(api_path(o) + "\t" + json.dumps(o, separators=(",", ":")) + "\n")
    return 0


def api_path(obj: dict[str, Any]) -> str:
    """Where the API server serves ``obj`` (the kinds this script emits)."""
    group = {"CustomResourceDefinition": "apiextensions.k8s.io/v1/customresourcedefinitions",
             "MutatingWebhookConfiguration": "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
             "ValidatingWebhookConfiguration": "admissionregistration.k8s.io/v1/validatingwebhookconfigurations"}
    return f"/apis/{group[obj['kind']]}/{obj['metadata']['name']}"


if __name__ == "__main__":
    sys.exit(main())
