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
# intake per batch (d64296d) against 0a54d96; listen-*: the registration listener (59ea5c3) against
# ce8f900; construct-*: validated construction and the smaller cuts (350f6f2) against 8b80f3f;
# batch2-*: the PNG header, the writer's room status and the dispatcher's intake per batch
# (0a5777e..324da6a) against 8e7eaa7 (batch2-mooncake8: 8-image requests over Mooncake alone);
# offer-*: the receiver's slot offers made once, against 15c5b3c (8-image requests over SHM)
# arrivals-*: a drain's rooms in one table call and the stream's answers without models (54f53f5)
# against the session's start, 2da6bea, in sequential pairs; together-*: the same, each round's
# two sides run at once (AT_ONCE=1 compare.sh)
TABLES = (
    ("cost", "123", "a25abee", "68c3ad2"),
    ("cost", "456", "a25abee", "0a15a9d"),
    ("ceiling", "123", "a25abee", "0a15a9d"),
    ("batch-cost", "123", "0a54d96", "d64296d"),
    ("batch-ceiling", "123", "0a54d96", "d64296d"),
    ("listen-ceiling", "123", "ce8f900", "59ea5c3"),
    ("construct-cost", "123", "8b80f3f", "350f6f2"),
    ("construct-ceiling", "123", "8b80f3f", "350f6f2"),
    ("batch2-cost", "123", "8e7eaa7", "324da6a"),
    ("batch2-ceiling", "123", "8e7eaa7", "324da6a"),
    ("batch2-mooncake8", "1234", "8e7eaa7", "324da6a"),
    ("offer-ceiling", "123", "15c5b3c", "991a2f4"),
    ("offer-cost", "123", "15c5b3c", "991a2f4"),
    ("jpeg-ceiling", "123456", "1d23076", "2fb58e2"),
    ("publish", "123456", "2fb58e2", "67764d4"),
    ("session-cost", "123", "1d23076", "67764d4"),
    ("webp-ceiling", "123", "4bf9256", "25a79ea"),
    ("arrivals-ceiling", "123", "2da6bea", "54f53f5"),
    ("arrivals-cost", "123", "2da6bea", "54f53f5"),
    ("together-ceiling", "123", "2da6bea", "54f53f5"),
    ("together-cost", "123", "2da6bea", "54f53f5"),
)


def handshake_table(prefix: str, pairs: str, path: tuple | None = None) -> list[str]:
    """The stream receiver's levels (``path``: only the rows of that opener, receiver and
    sender): rooms/s and p99, medians of the runs per side."""
    levels: dict[tuple, dict[str, list[dict]]] = {}
    for side in ("before", "after"):
        for run in runs(f"{prefix}-{side}-[{pairs}].json"):
            for row in run["levels"]:
                row_path = (row.get("opener"), row["receiver"], row.get("sender"))
                if row["receiver"] == "stream" and path in (None, row_path):
                    key = (row["batch"], row["concurrency"])
                    levels.setdefault(key, {}).setdefault(side, []).append(row)
    lines = [
        "| rooms per call, concurrency | rooms/s, before -> after | p99 ms, before -> after |",
        "|---|---|---|",
    ]
    for (batch, concurrency), sides in sorted(levels.items()):
        cells = [
            " -> ".join(median([row[field] for row in sides[side]]) for side in ("before", "after"))
            for field in ("rooms_per_s", "p99_ms")
        ]
        lines.append(f"| {batch}, {concurrency} | " + " | ".join(cells) + " |")
    return lines


HANDSHAKE_TABLES = (
    ("construct-handshake", "12", "8b80f3f", "350f6f2", None),
    ("session-handshake", "12", "4bf9256", "3aadcae", ("stream", "stream", "stream")),
    ("answers-handshake", "12", "2da6bea", "0cf22f7", ("stream", "stream", "stream")),
)


def pairs_table(pattern: str) -> list[str]:
    """The senders side by side in the same runs (``epd-bench handshake`` since the writer's
    stream): rooms/s and p99 per (batch, concurrency), medians of the runs."""
    levels: dict[tuple, dict[tuple, list[dict]]] = {}
    for run in runs(pattern):
        for row in run["levels"]:
            key = (row["batch"], row["concurrency"])
            pair = (row["receiver"], row["sender"])
            levels.setdefault(key, {}).setdefault(pair, []).append(row)
    pairs = [("stream", "stream"), ("stream", "rest"), ("rest", "rest")]
    lines = [
        "| rooms per call, concurrency | "
        + " | ".join(f"receiver {r}, sender {s}: rooms/s (p99 ms)" for r, s in pairs)
        + " |",
        "|---" * (len(pairs) + 1) + "|",
    ]
    for (batch, concurrency), by_pair in sorted(levels.items()):
        cells = [
            f"{median([row['rooms_per_s'] for row in by_pair[pair]])} "
            f"({median([row['p99_ms'] for row in by_pair[pair]])})"
            for pair in pairs
        ]
        lines.append(f"| {batch}, {concurrency} | " + " | ".join(cells) + " |")
    return lines


def frames_table(prefix: str) -> list[str]:
    """The frame policy alone (``frames.sh``): one frame per step and kind (whole) against
    ``step_frames`` (split), the stream receiver and sender after either opener: rooms/s (p99 ms),
    medians of the runs."""
    levels: dict[tuple, dict[tuple, list[dict]]] = {}
    for policy in ("whole", "split"):
        for run in runs(f"{prefix}-{policy}-*.json"):
            for row in run["levels"]:
                if row["receiver"] == row["sender"] == "stream":
                    key = (row["batch"], row["concurrency"])
                    levels.setdefault(key, {}).setdefault((row["opener"], policy), []).append(row)
    lines = [
        "| rooms per call, concurrency | stream opener: whole -> split "
        "| REST mint: whole -> split |",
        "|---|---|---|",
    ]
    for (batch, concurrency), by in sorted(levels.items()):
        cells = [
            " -> ".join(
                f"{median([row['rooms_per_s'] for row in by[opener, policy]])} "
                f"({median([row['p99_ms'] for row in by[opener, policy]])})"
                for policy in ("whole", "split")
            )
            for opener in ("stream", "rest")
        ]
        lines.append(f"| {batch}, {concurrency} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    for prefix, pairs, before, after in TABLES:
        if runs(f"{prefix}-before-[{pairs}].json"):
            print(f"\n{prefix}, {before} -> {after}:")
            print("\n".join(cost_table(prefix, pairs)))
    for prefix, pairs, before, after, path in HANDSHAKE_TABLES:
        if runs(f"{prefix}-before-[{pairs}].json"):
            print(f"\n{prefix}, {before} -> {after} (the stream receiver; path {path}):")
            print("\n".join(handshake_table(prefix, pairs, path)))
    if runs("writer-handshake-*.json"):
        print("\nwriter-handshake: the writer's stream against REST, in the same runs:")
        print("\n".join(pairs_table("writer-handshake-*.json")))
    if runs("frames-split-*.json"):
        print("\nframes: one frame per step against step_frames, in interleaved runs:")
        print("\n".join(frames_table("frames")))


if __name__ == "__main__":
    main()
