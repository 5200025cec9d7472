"""`epd-encode-worker`: run an encode worker until SIGTERM / SIGINT, then shut down cleanly.

Every flag has an environment variable (``EPD_`` + the flag in upper snake case, e.g.
``--bootstrap-port`` <- ``EPD_BOOTSTRAP_PORT``); flags win over the environment. Every setting
is checked before anything starts: a mistake is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from data_plane.offers import TRANSPORT_NAMES
from handshake.settings import (
    SettingError,
    byte_size,
    check_checkpoint,
    check_device,
    check_listen,
    check_memory,
    dtype,
    env_var,
    flag_parser,
    handshake_token,
    port,
    positive,
    read_secret,
    refuse,
    switch,
    transports,
)

PROG = "epd-encode-worker"
FLAGS = [
    # (flag, type, default, help)
    ("--model", str, None, "checkpoint directory (full VLM or vision-only)"),
    ("--served-model", str, None, "model name intake requests may carry (default: the checkpoint folder name)"),
    ("--dtype", dtype, "bfloat16", "tower dtype: bfloat16, float16, float32"),
    ("--device", str, "cpu", "torch device for the tower, e.g. cuda:0"),
    ("--host", str, "127.0.0.1", "address peers use to reach this worker (rooms, Mooncake)"),
    ("--bind", str, "0.0.0.0", "address the bootstrap and intake ports listen on"),
    ("--bootstrap-port", port, 8998, "handshake (room) REST port; also /healthz /readyz /metrics"),
    ("--intake-port", port, 8999, "ZMQ ROUTER port for items"),
    ("--transports", transports, "shm,mooncake", f"comma-separated: {', '.join(TRANSPORT_NAMES)}"),
    ("--mooncake-hca", str, "", "comma-separated RDMA HCA names for Mooncake ('' = all found)"),
    ("--mooncake-force-tcp", switch, "0", "1 = Mooncake over TCP even where RDMA exists"),
    ("--batch-patches", positive(int), 16384, "tower input patches per batch"),
    ("--batch-items", positive(int), 8, "items per batch"),
    ("--queue-items", positive(int), 64, "items waiting for the tower before intake refuses"),
    ("--queue-bytes", positive(byte_size), 1 << 30, "payload bytes waiting for the tower before intake refuses"),
    ("--max-payload-bytes", byte_size, 64 << 20, "largest accepted item payload (bytes; K, M, G suffixes)"),
    ("--max-image-pixels", positive(int), None, "largest image decoded, in pixels, refused at intake "
                                                "from its header (default 16777216 = 4096 x 4096)"),
    ("--batch-pixels", positive(int), None, "decoded pixels per batch (default: twice --max-image-pixels)"),
    ("--ring-bytes", byte_size, 512 << 20, "send ring size (registered once)"),
    ("--ring-slot-bytes", byte_size, 1 << 20, "send ring slot size"),
    ("--cache-bytes", byte_size, 1 << 30, "embedding cache size (0 = off)"),
    ("--receiver-wait-s", positive(float), 30.0, "how long an encoded item waits for its receiver; then its room fails"),
    ("--write-timeout-s", positive(float), 30.0, "deadline of one write"),
    ("--room-timeout-s", positive(float), 5.0, "deadline of one call to another endpoint's room API"),
    ("--checksum", switch, "1", "1 = commit with an xxh3-64 checksum of the rows (0: receivers must run with require_checksum off)"),
    ("--send-workers", positive(int), 8, "sender threads"),
    ("--token-file", str, None, "handshake bearer token file (or $EPD_HANDSHAKE_TOKEN[_FILE])"),
    ("--intake-token-file", str, None, "intake token file (or $EPD_INTAKE_TOKEN)"),
]


def env_name(flag: str) -> str:
    return env_var("EPD_", flag)


def build_parser() -> argparse.ArgumentParser:
    return flag_parser(PROG, "EPD encode worker.", "EPD_", FLAGS)


def config_from_args(args):
    """The worker's settings from parsed flags; ``SettingError`` for a missing model or an
    unreadable token file."""
    if not args.model:
        raise SettingError("--model (or EPD_MODEL) is required")
    check_checkpoint(args.model)
    intake_token = (read_secret(args.intake_token_file, "--intake-token-file") if args.intake_token_file
                    else os.environ.get("EPD_INTAKE_TOKEN") or None)
    token = handshake_token(args.token_file)
    from encode_worker.worker import WorkerConfig  # torch: after the quick checks

    sizes = {}
    if args.max_image_pixels is not None:
        sizes.update(max_image_pixels=args.max_image_pixels, batch_pixels=2 * args.max_image_pixels)
    if args.batch_pixels is not None:
        sizes.update(batch_pixels=args.batch_pixels)
    return WorkerConfig(
        model=args.model, served_model=args.served_model, dtype=args.dtype, device=args.device, host=args.host, bind=args.bind,
        bootstrap_port=args.bootstrap_port, intake_port=args.intake_port,
        transports=tuple(args.transports.split(",")), mooncake_hca=args.mooncake_hca,
        mooncake_force_tcp=args.mooncake_force_tcp, batch_patches=args.batch_patches,
        batch_items=args.batch_items, queue_items=args.queue_items, queue_bytes=args.queue_bytes,
        max_payload_bytes=args.max_payload_bytes,
        ring_bytes=args.ring_bytes, ring_slot_bytes=args.ring_slot_bytes, cache_bytes=args.cache_bytes,
        receiver_wait_s=args.receiver_wait_s, write_timeout_s=args.write_timeout_s, room_timeout_s=args.room_timeout_s,
        checksum=args.checksum, send_workers=args.send_workers, handshake_token=token,
        intake_token=intake_token, **sizes)


def start(args):
    """Check every setting, load the tower, listen: the running worker, or ``SettingError``."""
    check_listen(args.bind, args.bootstrap_port, "--bootstrap-port")
    check_listen(args.bind, args.intake_port, "--intake-port")
    if args.bootstrap_port == args.intake_port:
        raise SettingError(f"--bootstrap-port and --intake-port are both {args.intake_port}")
    config = config_from_args(args).validate()
    check_device(config.device)
    check_memory(config.ring_bytes, "--ring-bytes")
    from data_plane.mooncake import MooncakeUnavailable
    from encode_worker.tower import TowerLoadError, VisionTower
    from encode_worker.worker import EncodeWorker

    try:
        tower = VisionTower.load(config.model, config.dtype, config.device)
    except (TowerLoadError, OSError, ValueError) as exc:  # a checkpoint that is not a complete tower
        raise SettingError(f"--model {config.model}: cannot load the vision tower: {exc}") from None
    try:
        return EncodeWorker(config, tower=tower).start()
    except (MooncakeUnavailable, OSError, RuntimeError, MemoryError) as exc:  # transports, ring
        raise SettingError(f"cannot start: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        worker = start(args)
    except SettingError as exc:
        return refuse(PROG, exc)
    config = worker.config
    logging.info("encode worker ready: model %s (served as %r, %s on %s); rooms, /readyz and /metrics on "
                 "http://%s:%d (bound to %s); intake on tcp://%s:%d; transports %s", config.model,
                 worker.served_model, config.dtype, config.device, config.host, worker.bootstrap_port, config.bind,
                 config.host, worker.intake_port, ",".join(worker.transports))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    logging.info("stopping: intake closed, queued items failed, in-flight writes finishing")
    worker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
