"""The issue-32 tables (docs/performance.md) from the JSON beside this file: medians of the runs
per side, per process. Usage: python3 docs/results/issue32/summarise.py"""

import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
ROLES = ("dispatcher", "encode_worker", "receiver", "sum")


def runs(pattern: str) -> list[dict]:
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(HERE, pattern)))]


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}"


def cost_table(prefix: str, pairs: str) -> list[str]:
    before = runs(f"{prefix}-before-[{pairs}].json")
    after = runs(f"{prefix}-after-[{pairs}].json")
    heads = [
        f"{config['images_per_request']} img/req, {config['transport']}"
        for config in before[0]["configs"]
    ]
    lines = [
        f"| ms of CPU per item, before -> after ({len(before)} / {len(after)} runs) | "
        + " | ".join(heads)
        + " |",
        "|---" * (len(heads) + 1) + "|",
    ]
    for role in (*ROLES, "items/s"):
        cells = []
        for i in range(len(heads)):

            def value(run, role=role, i=i):
                config = run["configs"][i]
                if role == "items/s":
                    return config["items_per_s"]
                return config["control_plane_ms_per_item"][role]

            cells.append(
                f"{median([value(r) for r in before])} -> {median([value(r) for r in after])}"
            )
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    return lines


# (files, pairs, before, after): cost 1-3 against 68c3ad2 (the stream, the batch hand-off,
# staged), cost 4-6 and ceiling 1-3 against 0a15a9d (that session's end), before a25abee; batch-*:
# intake per batch (d64296d) against 0a54d96
TABLES = (
    ("cost", "123", "a25abee", "68c3ad2"),
    ("cost", "456", "a25abee", "0a15a9d"),
    ("ceiling", "123", "a25abee", "0a15a9d"),
    ("batch-cost", "123", "0a54d96", "d64296d"),
    ("batch-ceiling", "123", "0a54d96", "d64296d"),
)


def main() -> None:
    for prefix, pairs, before, after in TABLES:
        if runs(f"{prefix}-before-[{pairs}].json"):
            print(f"\n{prefix}, {before} -> {after}:")
            print("\n".join(cost_table(prefix, pairs)))


if __name__ == "__main__":
    main()
