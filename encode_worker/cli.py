"""`epd-encode-worker`: run an encode worker until SIGTERM / SIGINT, then shut down cleanly.

Every flag has an environment variable (``EPD_`` + the flag in upper snake case, e.g.
``--bootstrap-port`` <- ``EPD_BOOTSTRAP_PORT``); flags win over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from handshake.server import load_token

FLAGS = [
    # (flag, type, default, help)
    ("--model", str, None, "checkpoint directory (full VLM or vision-only)"),
    ("--served-model", str, None, "model name intake requests may carry (default: the checkpoint folder name)"),
    ("--dtype", str, "bfloat16", "tower dtype: bfloat16, float16, float32"),
    ("--device", str, "cpu", "torch device for the tower, e.g. cuda:0"),
    ("--host", str, "127.0.0.1", "address peers use to reach this worker (rooms, Mooncake)"),
    ("--bind", str, "0.0.0.0", "address the bootstrap and intake ports listen on"),
    ("--bootstrap-port", int, 8998, "handshake (room) REST port; also /healthz /readyz /metrics"),
    ("--intake-port", int, 8999, "ZMQ ROUTER port for items"),
    ("--transports", str, "shm,mooncake", "comma-separated: shm, mooncake, loopback"),
    ("--mooncake-hca", str, "", "comma-separated RDMA HCA names for Mooncake ('' = all found)"),
    ("--mooncake-force-tcp", int, 0, "1 = Mooncake over TCP even where RDMA exists"),
    ("--batch-patches", int, 16384, "tower input patches per batch"),
    ("--batch-items", int, 8, "items per batch"),
    ("--queue-items", int, 64, "items waiting for the tower before intake refuses"),
    ("--max-payload-bytes", int, 64 << 20, "largest accepted item payload"),
    ("--ring-bytes", int, 512 << 20, "send ring size (registered once)"),
    ("--ring-slot-bytes", int, 1 << 20, "send ring slot size"),
    ("--cache-bytes", int, 1 << 30, "embedding cache size (0 = off)"),
    ("--receiver-wait-s", float, 30.0, "how long an encoded item waits for its receiver"),
    ("--write-timeout-s", float, 30.0, "deadline of one write"),
    ("--checksum", int, 1, "1 = commit with an xxh3-64 checksum of the rows (0: receivers must run with require_checksum off)"),
    ("--send-workers", int, 8, "sender threads"),
    ("--token-file", str, None, "handshake bearer token file (or $EPD_HANDSHAKE_TOKEN[_FILE])"),
    ("--intake-token-file", str, None, "intake token file (or $EPD_INTAKE_TOKEN)"),
]


def env_name(flag: str) -> str:
    return "EPD_" + flag.lstrip("-").replace("-", "_").upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd-encode-worker", description="EPD encode worker.",
                                     epilog="Each flag also reads EPD_<FLAG> from the environment.")
    for flag, kind, default, text in FLAGS:
        value = os.environ.get(env_name(flag))
        parser.add_argument(flag, type=kind, default=kind(value) if value is not None else default,
                            help=f"{text} [{env_name(flag)}]")
    return parser


def config_from_args(args):
    from encode_worker.worker import WorkerConfig

    if not args.model:
        raise SystemExit("epd-encode-worker: --model (or EPD_MODEL) is required")
    intake_token = None
    if args.intake_token_file:
        with open(args.intake_token_file) as f:
            intake_token = f.read().strip()
    return WorkerConfig(
        model=args.model, served_model=args.served_model, dtype=args.dtype, device=args.device, host=args.host, bind=args.bind,
        bootstrap_port=args.bootstrap_port, intake_port=args.intake_port,
        transports=tuple(t for t in args.transports.split(",") if t), mooncake_hca=args.mooncake_hca,
        mooncake_force_tcp=bool(args.mooncake_force_tcp), batch_patches=args.batch_patches,
        batch_items=args.batch_items, queue_items=args.queue_items, max_payload_bytes=args.max_payload_bytes,
        ring_bytes=args.ring_bytes, ring_slot_bytes=args.ring_slot_bytes, cache_bytes=args.cache_bytes,
        receiver_wait_s=args.receiver_wait_s, write_timeout_s=args.write_timeout_s, checksum=bool(args.checksum),
        send_workers=args.send_workers, handshake_token=load_token(args.token_file),
        intake_token=intake_token or os.environ.get("EPD_INTAKE_TOKEN") or None)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(build_parser().parse_args(argv))
    from data_plane.mooncake import MooncakeUnavailable
    from encode_worker.worker import EncodeWorker

    try:
        worker = EncodeWorker(config).start()
    except MooncakeUnavailable as exc:  # the only transport asked for cannot start: say why, in one line
        logging.error("cannot start: %s", exc)
        return 1
    logging.info("encode worker ready: rooms on %s:%d, intake on %d, transports %s", config.host,
                 worker.bootstrap_port, worker.intake_port, ",".join(worker.transports))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    logging.info("stopping: intake closed, queued items failed, in-flight writes finishing")
    worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
