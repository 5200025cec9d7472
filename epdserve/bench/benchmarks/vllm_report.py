"""The report of `epd-bench vllm`: the per path and size medians over rounds, the goal (whether
this project's connector had the lowest delivery time at each size), the PNG plot (delivery,
TTFT and consumer CPU per image against image size) and the table printed at the end.
"""

from __future__ import annotations

import statistics

from epdserve.testing.vllm_servers import OURS


def _summary(raw: list[dict], sizes: list[int]) -> list[dict]:
    out = []
    for path in dict.fromkeys(row["path"] for row in raw):
        for size in sizes:
            rows = [row for row in raw if row["path"] == path and row["size"] == size]

            def med(key):
                values = [row[key] for row in rows if row[key] is not None]
                return statistics.median(values) if values else None

            deliveries = [
                statistics.median(row["delivery_ms"]) for row in rows if row["delivery_ms"]
            ]
            out.append(
                {
                    "path": path,
                    "size": size,
                    "ttft_ms": med("ttft_ms"),
                    "throughput_rps": med("throughput_rps"),
                    "delivery_ms": statistics.median(deliveries) if deliveries else None,
                    "cpu_ms_per_image": med("cpu_ms_per_image"),
                    "producer_cpu_ms_per_image": med("producer_cpu_ms_per_image"),
                }
            )
    return out


def _goal(summary: list[dict], sizes: list[int]) -> dict:
    """Per size: whether this project's connector had the lowest delivery time of all paths run."""
    goal = {}
    for size in sizes:
        rows = [row for row in summary if row["size"] == size and row["delivery_ms"] is not None]
        ours = [row["delivery_ms"] for row in rows if row["path"] in OURS]
        theirs = {row["path"]: row["delivery_ms"] for row in rows if row["path"] not in OURS}
        goal[str(size)] = {
            "ours_ms": min(ours) if ours else None,
            "peers_ms": theirs,
            "lowest": bool(ours) and all(min(ours) < value for value in theirs.values()),
        }
    return goal


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["config"]["sizes"]
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, key, title in zip(
        axes,
        ("delivery_ms", "ttft_ms", "cpu_ms_per_image"),
        (
            "delivery: encoded -> vLLM's encoder cache (ms)",
            "TTFT (ms)",
            "consumer CPU per image (ms)",
        ),
    ):
        for name in dict.fromkeys(row["path"] for row in report["summary"]):
            points = [
                (row["size"], row[key])
                for row in report["summary"]
                if row["path"] == name and row[key] is not None
            ]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("image side (px)")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)  # every path has a TTFT (colocated has no delivery)
    figure.suptitle(
        f"epd-bench vllm: width {report['config']['hidden']} {report['config']['dtype']}, "
        f"median of {report['config']['rounds']} rounds",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _print(report: dict) -> None:
    print(
        f"\n{'path':>13s} {'size':>5s} {'delivery ms':>12s} {'TTFT ms':>8s} {'req/s':>6s} "
        f"{'CPU ms/img':>11s}"
    )
    for row in report["summary"]:
        delivery = f"{row['delivery_ms']:.2f}" if row["delivery_ms"] is not None else "-"
        print(
            f"{row['path']:>13s} {row['size']:>5d} {delivery:>12s} {row['ttft_ms']:>8.1f} "
            f"{row['throughput_rps']:>6.2f} {row['cpu_ms_per_image']:>11.1f}"
        )
    for path, why in report["unavailable"].items():
        print(f"{path}: unavailable: {why}")
    for size, goal in report["goal"].items():
        print(
            f"size {size}: EPD connector lowest delivery time: {'yes' if goal['lowest'] else 'NO'} "
            f"(ours {goal['ours_ms']}, peers {goal['peers_ms']})"
        )
