"""`epd-bench`: the project's benchmarks, one subcommand each, and `compare`, which runs one of
them at two git revisions side by side."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    transfer = sub.add_parser(
        "transfer", help="bytes into a receiver's slot: memcpy vs shm vs mooncake vs loopback"
    )
    transfer.add_argument(
        "--sizes", default="1M,16M,128M", help="comma-separated sizes (K/M/G suffixes)"
    )
    transfer.add_argument("--rounds", type=int, default=None, help="timed rounds per path and size")
    transfer.add_argument("--json", default=None, help="write the results to this file")
    handshake = sub.add_parser(
        "handshake", help="room lifecycles per second through the client, single and batch-8"
    )
    handshake.add_argument(
        "--seconds", type=float, default=1.0, help="duration of each concurrency level per round"
    )
    handshake.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (median per level)"
    )
    handshake.add_argument("--json", default=None, help="write the results to this file")
    headers = sub.add_parser(
        "headers", help="image header reads: us per image, the product's and Pillow's, vs budget"
    )
    headers.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians)")
    headers.add_argument("--calls", type=int, default=2000, help="reads per file, reader, round")
    headers.add_argument("--json", default=None, help="write the results to this file")
    encode = sub.add_parser(
        "encode",
        help="encode worker items/s: its tower alone, delivery vs a null sink, batched vs single",
    )
    encode.add_argument("--items", type=int, default=48, help="images per round and size")
    encode.add_argument(
        "--sizes",
        "--size",
        default="448",
        help="comma-separated image sizes: a side (448) or width x height (1280x720)",
    )
    encode.add_argument("--device", default="cpu", help="the tower's device (cpu, cuda, cuda:N)")
    encode.add_argument(
        "--full-size",
        action="store_true",
        help="--family's released vision config (random weights) instead of the small tower",
    )
    encode.add_argument(
        "--family", default="qwen2_5_vl", help="with --full-size: qwen2_vl, qwen2_5_vl, qwen3_vl"
    )
    encode.add_argument("--depth", type=int, default=2, help="small tower: layers")
    encode.add_argument("--hidden", type=int, default=64, help="small tower: ViT width")
    encode.add_argument(
        "--width", type=int, default=3584, help="small tower: output width (Qwen2.5-VL-7B: 3584)"
    )
    encode.add_argument(
        "--dtype", default="float32", help="tower dtype (bfloat16 is ~5x slower on this CPU)"
    )
    encode.add_argument(
        "--vision-attention",
        choices=("auto", "varlen", "reference"),
        default="auto",
        help="the worker's tower attention (auto: varlen where Flash runs)",
    )
    encode.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="the worker's tower compiled (varlen path; auto: on CUDA with Triton and a C "
        "compiler); with --tower-batches also timed alone beside the eager paths",
    )
    encode.add_argument(
        "--tower-batches",
        default="",
        help="comma-separated batch sizes: also time the tower alone, varlen against reference "
        "(and compiled)",
    )
    encode.add_argument(
        "--no-single", action="store_true", help="the pipeline at the batch budget only"
    )
    encode.add_argument(
        "--instant-tower",
        action="store_true",
        help="the worker's CPU budget: a tower that returns its rows at once, the GPU's batch "
        "budget; CPU per image by thread and the rate it could feed an infinitely fast GPU",
    )
    encode.add_argument("--transport", choices=("shm", "mooncake"), default="shm")
    encode.add_argument("--rounds", type=int, default=3)
    encode.add_argument("--json", default=None)
    grid_inputs = sub.add_parser(
        "grid-inputs",
        help="the tower thread's CPU per batch for the forward's grid-derived inputs: "
        "transformers' helpers over the batch vs assembled from per-grid parts",
    )
    grid_inputs.add_argument("--rounds", type=int, default=30, help="interleaved rounds (median)")
    grid_inputs.add_argument("--json", default=None)
    patch_embed = sub.add_parser(
        "patch-embed",
        help="the towers' patch embedding: transformers' Conv3d vs one matrix product",
    )
    patch_embed.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    patch_embed.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    patch_embed.add_argument("--json", default=None)
    receive = sub.add_parser(
        "receive", help="receive-path overhead per item beyond the raw transfer"
    )
    receive.add_argument("--jobs", type=int, default=60)
    receive.add_argument("--json", default=None)
    e2e = sub.add_parser(
        "e2e", help="multi-image requests through real processes: EPD vs colocated"
    )
    e2e.add_argument(
        "--images-per-request", default="1,8", help="comma-separated, one configuration each"
    )
    e2e.add_argument("--size", type=int, default=448, help="square image side in pixels")
    e2e.add_argument("--concurrency", type=int, default=4, help="concurrent clients (closed loop)")
    e2e.add_argument(
        "--seconds", type=float, default=5.0, help="duration of each configuration per round"
    )
    e2e.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (median per configuration)"
    )
    e2e.add_argument("--transport", choices=("shm", "mooncake"), default="shm")
    e2e.add_argument("--cache", action="store_true", help="embedding cache on, images repeat")
    e2e.add_argument("--model", default=None, help="checkpoint (default: the demo's small tower)")
    e2e.add_argument("--dtype", default="float32")
    e2e.add_argument("--json", default=None)
    e2e.add_argument(
        "--plot", default="e2e.png", help="PNG plot path ('' for none); its raw JSON goes beside it"
    )
    soak = sub.add_parser(
        "soak", help="real processes under random faults: corruption, leaks, time to failure"
    )
    soak.add_argument("--items", type=int, default=1000, help="items to send, normal and faulted")
    soak.add_argument("--fault-rate", type=float, default=0.05, help="fault events per item")
    soak.add_argument("--concurrency", type=int, default=3, help="clients sending normal traffic")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument(
        "--kinds", default=None, help="comma-separated fault scenarios (default: all)"
    )
    soak.add_argument(
        "--model",
        default=None,
        help="checkpoint (default: a small Qwen2.5-VL tower, 2048-wide rows)",
    )
    soak.add_argument(
        "--rooms-at-handshake",
        action="store_true",
        help="normal traffic's rooms opened at the standalone handshake over its room stream "
        "(as epd-dispatch --rooms-url), not at each item's worker",
    )
    soak.add_argument("--json", default=None)
    vllm = sub.add_parser(
        "vllm",
        help="vLLM's encoder cache fed by this connector (SHM, Mooncake) vs vLLM's own "
        "EC connectors vs colocated: delivery time, TTFT, throughput, CPU per image",
    )
    vllm.add_argument(
        "--paths",
        default="epd-shm,epd-shm-staged,epd-mooncake,example,mooncake-ec,cpu-ec,colocated",
        help="comma-separated paths to run",
    )
    vllm.add_argument(
        "--sizes",
        default="224,448,896",
        help="square image sides in pixels, one configuration each",
    )
    vllm.add_argument("--requests", type=int, default=4, help="requests per path, size and round")
    vllm.add_argument("--concurrency", type=int, default=1, help="concurrent clients (closed loop)")
    vllm.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (median per path and size)"
    )
    vllm.add_argument(
        "--hidden",
        type=int,
        default=2048,
        help="the model's width = the width of every embedding row",
    )
    vllm.add_argument("--layers", type=int, default=1, help="LLM layers of the benchmark model")
    vllm.add_argument("--dtype", default="float32")
    vllm.add_argument("--json", default=None)
    vllm.add_argument("--plot", default="vllm.png", help="PNG plot path ('' for none)")
    gateway = sub.add_parser(
        "gateway", help="epd-gateway's added TTFT and CPU per image vs calling vLLM directly"
    )
    gateway.add_argument("--sizes", default="224,448,896", help="square image sides in pixels")
    gateway.add_argument(
        "--requests", type=int, default=6, help="requests per path, size and round"
    )
    gateway.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (median per path and size)"
    )
    gateway.add_argument("--max-tokens", type=int, default=4)
    gateway.add_argument(
        "--scenario",
        choices=("latency", "burst", "steady", "mixed"),
        default="latency",
        help="latency: added TTFT per path; burst: requests at once; steady: requests at --rate; "
        "mixed: as steady, 1 to --images images of --mixed-sizes each (gateways compared by "
        "--compare)",
    )
    gateway.add_argument(
        "--compare",
        choices=("inline-cap", "placement"),
        default="inline-cap",
        help="burst, steady, mixed: refused (--max-inline-patches 0) against overflowed to vLLM "
        "inline (inline-cap), or the --placement values of --policies (placement)",
    )
    gateway.add_argument(
        "--policies",
        type=lambda text: text.split(","),
        default=["workers", "cost"],
        help="--compare placement: comma-separated --placement values",
    )
    gateway.add_argument(
        "--burst-requests", type=int, default=24, help="burst: requests at once per gateway"
    )
    gateway.add_argument(
        "--rate", type=float, default=8.0, help="steady, mixed: requests per second (Poisson)"
    )
    gateway.add_argument(
        "--seconds", type=float, default=15.0, help="steady, mixed: seconds of arrivals a round"
    )
    gateway.add_argument(
        "--images", type=int, default=4, help="burst, steady: images per request; mixed: most"
    )
    gateway.add_argument("--size", type=int, default=224, help="burst, steady: square image side")
    gateway.add_argument(
        "--mixed-sizes",
        type=lambda text: [int(side) for side in text.split(",")],
        default=[112, 224, 448],
        help="mixed: the square image sides drawn from",
    )
    gateway.add_argument(
        "--queue-items",
        type=int,
        default=16,
        help="burst, steady, mixed: the encode worker's queue",
    )
    gateway.add_argument(
        "--pause-s", type=float, default=3.0, help="burst, steady, mixed: idle time after a round"
    )
    gateway.add_argument("--seed", type=int, default=0, help="burst, steady, mixed: workloads")
    gateway.add_argument("--json", default=None)
    coalesce = sub.add_parser(
        "coalesce",
        help="Zipf-distributed images into two encode workers: tower items per distinct image",
    )
    coalesce.add_argument("--items", type=int, default=10_000, help="one-image requests")
    coalesce.add_argument(
        "--catalogue", type=int, default=2_000, help="distinct images to draw from"
    )
    coalesce.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent")
    coalesce.add_argument("--concurrency", type=int, default=64, help="concurrent clients")
    coalesce.add_argument("--size", type=int, default=112, help="square image side in pixels")
    coalesce.add_argument("--seed", type=int, default=0)
    coalesce.add_argument("--json", default=None)
    overload = sub.add_parser(
        "overload", help="thousands of items in flight through the dispatcher: none lost"
    )
    overload.add_argument("--requests", type=int, default=200, help="requests started at once")
    overload.add_argument("--images-per-request", type=int, default=10)
    overload.add_argument(
        "--waves", type=int, default=2, help="bursts, each once the last has ended"
    )
    overload.add_argument(
        "--workers", default="1,2", help="comma-separated encode worker counts, one phase each"
    )
    overload.add_argument("--size", type=int, default=224, help="square image side in pixels")
    overload.add_argument(
        "--deadline-s", type=float, default=60.0, help="each request's receive deadline"
    )
    overload.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=None,
        help="the encode workers' --max-queue-wait-s (default: theirs)",
    )
    overload.add_argument("--json", default=None)
    cost = sub.add_parser(
        "cost",
        help="CPU ms per item in each process outside the tower (dispatcher, worker, prefill)",
    )
    cost.add_argument("--images-per-request", default="1,8", help="comma-separated")
    cost.add_argument("--transports", default="shm,mooncake", help="comma-separated")
    cost.add_argument("--size", type=int, default=112, help="square image side in pixels")
    cost.add_argument("--image-format", choices=("PNG", "JPEG", "WEBP"), default="PNG")
    cost.add_argument("--seconds", type=float, default=10.0, help="steady run per configuration")
    cost.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    cost.add_argument(
        "--ceiling",
        action="store_true",
        help="the stand-in worker (a tower that costs nothing, items that need no "
        "preprocessing): items/s is the control plane's ceiling",
    )
    cost.add_argument("--json", default=None)
    batching = sub.add_parser(
        "batching", help="the batching window: batch sizes under bursts, a lone item's wait"
    )
    batching.add_argument(
        "--windows", default="0,0.002,0.005", help="comma-separated windows in seconds"
    )
    batching.add_argument("--burst", type=int, default=8, help="items sent back to back")
    batching.add_argument("--bursts", type=int, default=12, help="bursts per round")
    batching.add_argument("--lone", type=int, default=20, help="lone items per round")
    batching.add_argument("--size", type=int, default=224, help="square image side in pixels")
    batching.add_argument("--rounds", type=int, default=3)
    batching.add_argument("--json", default=None)
    kill = sub.add_parser(
        "worker-kill",
        help="requests in flight when their encode worker is killed: time to their answer",
    )
    kill.add_argument("--requests", type=int, default=20, help="requests sent at once")
    kill.add_argument("--kill-after", type=int, default=4, help="items the worker takes first")
    kill.add_argument("--size", type=int, default=112, help="square image side in pixels")
    kill.add_argument("--max-tokens", type=int, default=4)
    kill.add_argument("--rounds", type=int, default=3)
    kill.add_argument("--json", default=None)
    fingerprint = sub.add_parser(
        "fingerprint",
        help="start-up cost of a model fingerprint: a full-size tower's weights digest",
    )
    fingerprint.add_argument(
        "--family", default="qwen2_5_vl", help="qwen2_vl, qwen2_5_vl or qwen3_vl (released config)"
    )
    fingerprint.add_argument("--dtype", default="bfloat16", help="the checkpoint's stored dtype")
    fingerprint.add_argument("--rounds", type=int, default=3, help="rounds per level (median)")
    fingerprint.add_argument("--json", default=None)
    compare = sub.add_parser(
        "compare",
        usage="epd-bench compare [options] A B [--] BENCHMARK [ARGS...]",
        help="one benchmark at two git revisions, side by side: medians and B/A ratios",
        description="Runs `epd-bench BENCHMARK ARGS...` in a git worktree of revision A and one "
        "of B (PYTHONPATH at each, this interpreter), rounds interleaved (A B, B A, ...) or at "
        "once; writes each run's JSON and log and summary.json (every figure's values, medians "
        "and B/A) to --out, prints the figures that moved, removes the worktrees.",
    )
    compare.add_argument("a", help="revision A, the baseline (a commit, branch or tag)")
    compare.add_argument("b", help="revision B")
    compare.add_argument(
        "benchmark_args",
        nargs=argparse.REMAINDER,
        help="the benchmark and its arguments as epd-bench takes them, without --json",
    )
    compare.add_argument("--out", required=True, help="a new or empty directory for the results")
    compare.add_argument("--rounds", type=int, default=3, help="runs per revision, interleaved")
    compare.add_argument(
        "--at-once",
        action="store_true",
        help="run a round's two sides at the same time (same pace, half the machine each)",
    )
    compare.add_argument(
        "--harness",
        choices=("own", "b"),
        default="own",
        help="benchmark code each side runs: its own, or B's on both (only the product differs)",
    )
    compare.add_argument(
        "--timeout-s", type=float, default=3600.0, help="the most one run may take"
    )
    compare.add_argument(
        "--python", default=sys.executable, help="the interpreter both sides run under"
    )
    compare.add_argument("--repo", default=".", help="a directory inside the git repository")
    compare.set_defaults(benchmarks=[name for name in sub.choices if name != "compare"])
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    args = build_parser().parse_args(argv)
    if args.command == "transfer":
        from epdserve.bench.benchmarks import transfer

        return transfer.main(args)
    if args.command == "grid-inputs":
        from epdserve.bench.benchmarks import grid_inputs

        return grid_inputs.main(args)
    if args.command == "patch-embed":
        from epdserve.bench.benchmarks import patch_embed

        return patch_embed.main(args)
    if args.command == "receive":
        from epdserve.bench.benchmarks import receive

        return receive.main(args)
    if args.command == "encode":
        from epdserve.bench.benchmarks import encode

        return encode.main(args)
    if args.command == "e2e":
        from epdserve.bench.benchmarks import e2e

        return e2e.main(args)
    if args.command == "soak":
        from epdserve.bench.faults import soak

        return soak.main(args)
    if args.command == "vllm":
        from epdserve.bench.benchmarks import vllm

        return vllm.main(args)
    if args.command == "gateway":
        if args.scenario != "latency":
            from epdserve.bench.benchmarks import gateway_load

            return gateway_load.main(args)
        from epdserve.bench.benchmarks import gateway

        return gateway.main(args)
    if args.command == "coalesce":
        from epdserve.bench.benchmarks import coalesce

        return coalesce.main(args)
    if args.command == "overload":
        from epdserve.bench.benchmarks import overload

        return overload.main(args)
    if args.command == "cost":
        from epdserve.bench.benchmarks import cost

        return cost.main(args)
    if args.command == "batching":
        from epdserve.bench.benchmarks import batching

        return batching.main(args)
    if args.command == "worker-kill":
        from epdserve.bench.benchmarks import worker_kill

        return worker_kill.main(args)
    if args.command == "fingerprint":
        from epdserve.bench.benchmarks import fingerprint

        return fingerprint.main(args)
    if args.command == "handshake":
        from epdserve.bench.benchmarks import handshake

        return handshake.main(args)
    if args.command == "headers":
        from epdserve.bench.benchmarks import headers

        return headers.main(args)
    if args.command == "compare":
        from epdserve.bench import compare

        return compare.main(args, args.benchmarks)
    return 2


if __name__ == "__main__":
    sys.exit(main())
