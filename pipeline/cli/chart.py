"""The Helm chart's ``values.schema.json`` (``deploy/helm/fleetmedic``).

The chart's own values (image, worker, collector, ...) are described here; ``config``
is fleetmedic's settings schema itself, taken from :class:`pipeline.config.Settings`, so
``helm lint`` and ``helm install`` refuse an unknown section or field, or a value of the
wrong type, before a pod is started with it.  ``fleetmedic chart-schema`` rewrites the
file; a test checks it is current.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline import paths

SCHEMA_FILE = ("helm", "fleetmedic", "values.schema.json")


def _obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": props, **extra}


_QUANTITY = {"type": ["string", "number"], "pattern": r"^[0-9.]+(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"}
_RESOURCES = _obj({
    "requests": {"type": "object", "properties": {"cpu": _QUANTITY, "memory": _QUANTITY}},
    "limits": {"type": "object", "properties": {"cpu": _QUANTITY, "memory": _QUANTITY}},
}, description="the container's resources (requests and limits)")
_K8S_LIST = {"type": "array", "items": {"type": "object"}}
_K8S_MAP = {"type": "object"}


def values_schema() -> dict[str, Any]:
    from pipeline.config import Settings

    settings = Settings.model_json_schema()
    defs = settings.pop("$defs", {})
    settings["description"] = ("fleetmedic's configuration (fleetmedic.json in the ConfigMap), section by section (`fleetmedic config` lists every field); "
                               "fields left out take their defaults")
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "fleetmedic chart values",
        **_obj({
            "global": _K8S_MAP,
            "image": _obj({
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string", "description": "default: the chart's appVersion"},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }, required=["repository"]),
            "imagePullSecrets": {"type": "array", "items": _obj({"name": {"type": "string", "minLength": 1}},
                                                                required=["name"])},
            "config": {"$ref": "#/$defs/Settings"},
            "secretEnv": {"type": "array", "items": _obj({
                "name": {"type": "string", "pattern": "^FLEETMEDIC_[A-Z0-9_]+__[A-Z0-9_]+$",
                         "description": "FLEETMEDIC_<SECTION>__<KEY>"},
                "secretName": {"type": "string", "minLength": 1},
                "key": {"type": "string", "minLength": 1},
            }, required=["name", "secretName", "key"])},
            "worker": _obj({
                "replicas": {"type": "integer", "minimum": 0},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "resources": _RESOURCES,
                "nodeSelector": _K8S_MAP, "tolerations": _K8S_LIST, "affinity": _K8S_MAP,
                "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                "podDisruptionBudget": _obj({
                    "enabled": {"type": "boolean"},
                    "maxUnavailable": {"type": ["integer", "string"], "minimum": 0, "pattern": "^[0-9]+%$"},
                }),
            }),
            "watch": _obj({"enabled": {"type": "boolean"}, "resources": _RESOURCES}),
            "collector": _obj({
                "enabled": {"type": "boolean"},
                "intervalSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
                "nodeSelector": _K8S_MAP, "tolerations": _K8S_LIST,
                "maxUnavailable": {"type": ["integer", "string"], "minimum": 0, "pattern": "^[0-9]+%$"},
                "resources": _RESOURCES,
            }),
            "diagnostics": _obj({
                "namespace": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "createNamespace": {"type": "boolean"},
            }),
            "rbac": _obj({"create": {"type": "boolean"}}),
            "serviceAccount": _obj({"create": {"type": "boolean"}, "name": {"type": "string"}}),
            "networkPolicy": _obj({"enabled": {"type": "boolean"}, "ingressFrom": _K8S_LIST}),
            "serviceMonitor": _obj({
                "enabled": {"type": "boolean"},
                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            }),
        }),
        "$defs": {"Settings": settings, **defs},
    }
    return schema


def render() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=False) + "\n"


def schema_path() -> Path:
    return paths.deploy_dir().joinpath(*SCHEMA_FILE)
