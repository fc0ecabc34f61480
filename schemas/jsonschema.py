"""JSON Schema files for external consumers, generated from the records.

``python -m schemas.jsonschema`` rewrites ``schemas/json/``; a test fails when the
committed files drift from the records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .records import PUBLIC_RECORDS

JSON_DIR = Path(__file__).resolve().parent / "json"
BASE_ID = "https://fleetmedic.dev/schemas/"


def render(name: str) -> str:
    model = PUBLIC_RECORDS[name]
    schema = model.model_json_schema(by_alias=True, mode="serialization")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"{BASE_ID}{name}.schema.json", **schema}
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def expected_files() -> dict[str, str]:
    return {f"{name}.schema.json": render(name) for name in PUBLIC_RECORDS}


def write(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, text in expected_files().items():
        path = directory / fname
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
