"""docs/openapi.yaml documents exactly the routes the operator API registers."""

from __future__ import annotations

import re

import faust
import yaml

from pipeline.api import views as api
from pipeline.api.auth import NoAuth
from pipeline.worker.procs import ROOT


def _registered() -> dict[str, set[str]]:
    app = faust.App("openapi-test", autodiscover=False, web_enabled=False)

    async def nothing(*_):
        return None

    return api.install(app, api.ApiContext(auth=NoAuth(), node_table={}, job_table={}, send_verdict=nothing,
                                           send_node_notice=nothing, dry_run=lambda: False,
                                           set_dry_run=nothing, held=dict, settle_held=nothing))


def test_every_route_is_documented_with_its_methods() -> None:
    doc = yaml.safe_load((ROOT / "docs" / "openapi.yaml").read_text())
    documented = {p: {m for m in ops if m in ("get", "post", "put", "delete", "patch")} for p, ops in doc["paths"].items()}
    registered = {p: ms for p, ms in _registered().items() if p.startswith("/api/")}
    assert registered, "no API routes registered"
    assert set(registered) == set(documented)
    for path, methods in registered.items():
        assert methods == documented[path], path
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        for m, op in ops.items():
            if op.get("security") == []:
                continue  # public
            assert {"401", "403"} <= set(op["responses"]), (path, m)
            assert re.fullmatch(r"/api/v1/[a-z{}/-]+", path)
