"""Where a benchmark's report goes: the JSON file its ``--json`` names."""

from __future__ import annotations

import json
import math


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` to ``path`` (nothing when None) and say so; values JSON cannot hold
    (enums, paths) are written as their text."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {path}")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` by nearest rank (the smallest value with at least ``q`` of
    them at or below it), None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
