"""Where a benchmark's report goes: the JSON file its ``--json`` names."""

from __future__ import annotations

import json


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` to ``path`` (nothing when None) and say so; values JSON cannot hold
    (enums, paths) are written as their text."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {path}")
