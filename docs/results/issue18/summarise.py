"""Before/after table of docs/performance.md (issue 18) from the JSON beside this file."""

import glob
import json
import os
import statistics

D = os.path.dirname(os.path.abspath(__file__))


def load(pattern):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{D}/{pattern}"))]


rows = []


def add(name, before, after, better):
    b, a = statistics.median(before), statistics.median(after)
    rows.append((name, len(before), b, a, a / b, better))


eb, ea = load("encode-before-*.json"), load("encode-after-*.json")
add(
    "encode ratio delivered/null (batched)",
    [r["ratios"]["delivered/null (batched)"] for r in eb],
    [r["ratios"]["delivered/null (batched)"] for r in ea],
    "higher",
)
for cfg in eb[0]["configs"]:
    add(
        f"encode {cfg} items/s",
        [r["configs"][cfg]["items_per_s"] for r in eb],
        [r["configs"][cfg]["items_per_s"] for r in ea],
        "higher",
    )
rb, ra = load("receive-before-*.json"), load("receive-after-*.json")
for cfg in ("1_image", "1_image_zero_copy", "8_image", "8_image_zero_copy"):
    add(
        f"receive {cfg}: overhead per item p50 ms",
        [r[cfg]["p50_ms"] for r in rb],
        [r[cfg]["p50_ms"] for r in ra],
        "lower",
    )
hb, ha = load("handshake-before-[56].json"), load("handshake-after-[56].json")
for i, level in enumerate(hb[0]["levels"]):
    add(
        f"handshake batch {level['batch']} x{level['concurrency']} lifecycles/s (runs 5-6)",
        [r["levels"][i]["lifecycles_per_s"] for r in hb],
        [r["levels"][i]["lifecycles_per_s"] for r in ha],
        "higher",
    )
hb, ha = load("handshake-before-[1-4].json"), load("handshake-after-[1-4].json")
for i, level in enumerate(hb[0]["levels"][:1]):
    add(
        "handshake batch 1 x1 lifecycles/s (runs 1-4, torch in the server)",
        [r["levels"][i]["lifecycles_per_s"] for r in hb],
        [r["levels"][i]["lifecycles_per_s"] for r in ha],
        "higher",
    )
for pattern, label in (
    ("e2e-before-*.json", "e2e"),
    ("e2e-1img-before-*.json", "e2e (1-image rerun)"),
):
    b, a = load(pattern), load(pattern.replace("before", "after"))
    for i, cfg in enumerate(b[0]["configs"]):
        name = f"{label} {cfg['mode']} {cfg['images_per_request']} img/req"
        add(
            f"{name} img/s",
            [r["configs"][i]["images_per_s"] for r in b],
            [r["configs"][i]["images_per_s"] for r in a],
            "higher",
        )
print(
    "| figure | runs per side | before (median) | after (median) | after / before |\n"
    "|---|---|---|---|---|"
)
for name, n, b, a, r, better in rows:
    print(f"| {name} ({better} is better) | {n} | {b:.2f} | {a:.2f} | {r:.2f} |")
