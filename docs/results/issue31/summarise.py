"""The issue-31 side-by-side table (docs/performance.md) from the JSON beside this file: medians of
the runs per side. Usage: python3 docs/results/issue31/summarise.py"""

import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(pattern: str) -> list[dict]:
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(HERE, pattern)))]


def row(figure: str, before: list[float], after: list[float]) -> str:
    b, a = statistics.median(before), statistics.median(after)
    return f"| {figure} | {len(before)} / {len(after)} | {b:.2f} | {a:.2f} | {a / b:.2f} |"


def cost_rows(before: list[dict], after: list[dict]):
    for i, config in enumerate(before[0]["configs"]):
        name = f"cost {config['images_per_request']} img/req over {config['transport']}"
        for field, label in (
            (lambda c: c["control_plane_ms_per_item"]["sum"], "control plane ms/item (lower)"),
            (lambda c: c["items_per_s"], "items/s (higher)"),
        ):
            yield row(
                f"{name}: {label}",
                [field(run["configs"][i]) for run in before],
                [field(run["configs"][i]) for run in after],
            )


def encode_rows(before: list[dict], after: list[dict]):
    for name in before[0]["sizes"]["448"]["pipeline"]["configs"]:

        def rate(run, name=name):
            return run["sizes"]["448"]["pipeline"]["configs"][name]["items_per_s"]

        yield row(
            f"encode 448 {name} items/s (higher)", *[[rate(r) for r in s] for s in (before, after)]
        )


def handshake_rows(before: list[dict], after: list[dict], label: str):
    for i, level in enumerate(before[0]["levels"]):
        yield row(
            f"handshake batch {level['batch']} x{level['concurrency']} lifecycles/s, {label} "
            "(higher)",
            [run["levels"][i]["lifecycles_per_s"] for run in before],
            [run["levels"][i]["lifecycles_per_s"] for run in after],
        )


def main() -> None:
    print("| figure | runs before / after | before (median) | after (median) | after / before |")
    print("|---|---|---|---|---|")
    lines = [
        *cost_rows(
            runs("cost-encode/cost31-before-*.json"), runs("cost-encode/cost31-after-*.json")
        ),
        *encode_rows(
            runs("cost-encode/enc31-before-*.json"), runs("cost-encode/enc31-after-*.json")
        ),
        *handshake_rows(
            runs("handshake-router/hs-before-[1-5].json"),
            runs("handshake-router/hs-router-*.json"),
            "first router",
        ),
        *handshake_rows(
            runs("handshake-router/hs-before-[6-8].json"),
            runs("handshake-router/hs-exact-*.json"),
            "exact-path match",
        ),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
