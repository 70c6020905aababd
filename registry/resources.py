"""Where the shipped schema sources live: inside the wheel, or at the top of a checkout."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _find(installed: str, checkout: str) -> Path:
    for candidate in (_HERE / installed, _HERE.parent / checkout):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"kvgraft is installed without its {checkout}/ folder")


def migrations_dir() -> Path:
    return _find("_migrations", "migrations")


def schemas_dir() -> Path:
    return _find("_schemas", "schemas")


@cache
def load_schema(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((schemas_dir() / f"{name}.schema.json").read_text())
    return data
