"""`epd-encode-worker`: run an encode worker until SIGTERM / SIGINT, then shut down cleanly.

Its flags, environment variables (``EPD_`` + the flag in upper snake case, e.g.
``--bootstrap-port`` <- ``EPD_BOOTSTRAP_PORT``; flags win) and ``--help`` come from
``encode_worker.config.WorkerConfig``. Every setting is checked before anything starts: a
mistake is one line on stderr and exit status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import NoReturn

from encode_worker.config import WorkerConfig
from epdserve.process_settings import (
    SettingError,
    check_checkpoint,
    check_device,
    check_listen,
    check_memory,
    exit_process,
    refuse,
)


def start(config: WorkerConfig):
    """Check what needs the machine, load the tower, listen: the running worker, or
    ``SettingError``."""
    directory = check_checkpoint(config.model)
    check_listen(config.bind, config.bootstrap_port, "--bootstrap-port")
    check_listen(config.bind, config.intake_port, "--intake-port")
    check_device(config.device)
    check_memory(config.ring_bytes, "--ring-bytes")
    from encode_worker.worker import EncodeWorker
    from epdserve.data_plane.mooncake import MooncakeUnavailable  # torch: after the quick checks
    from epdserve.vision.compilation import CompileUnavailable
    from epdserve.vision.tower import TowerLoadError, VisionTower

    try:
        tower = VisionTower.load(
            directory,
            config.dtype,
            config.device,
            config.mm_processor_kwargs,
            config.vision_attention,
            config.compile,
            config.compile_cache_dir,
        )
    except CompileUnavailable as exc:
        raise SettingError(f"--compile {config.compile}: {exc}") from None
    except (
        TowerLoadError,
        OSError,
        ValueError,
    ) as exc:  # a checkpoint that is not a complete tower
        raise SettingError(f"--model {config.model}: cannot load the vision tower: {exc}") from None
    try:
        return EncodeWorker(config, tower=tower).start()
    except (MooncakeUnavailable, OSError, RuntimeError, MemoryError) as exc:  # transports, ring
        raise SettingError(f"cannot start: {exc}") from None


def main(argv: list[str] | None = None) -> NoReturn:
    """Run until SIGTERM / SIGINT; a refused start is one line on stderr and exit status 1. The
    process ends through ``exit_process`` either way."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        worker = start(WorkerConfig.from_command_line(argv))
    except SettingError as exc:
        exit_process(refuse(WorkerConfig.PROG, exc))
    config = worker.config
    logging.info(
        "encode worker ready: model %s (served as %r, %s on %s, attention: %s, compiled: %s); "
        "rooms, /readyz and /metrics on "
        "http://%s:%d (bound to %s); intake on tcp://%s:%d; transports %s",
        config.model,
        worker.served_model,
        config.dtype,
        config.device,
        worker.tower.attention_kernel,
        worker.tower.compile_reason if worker.tower.compiled else "no",
        config.host,
        worker.bootstrap_port,
        config.bind,
        config.host,
        worker.intake_port,
        ",".join(worker.transports),
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    logging.info("stopping: intake closed, queued items failed, in-flight writes finishing")
    worker.stop()
    exit_process(0)


if __name__ == "__main__":
    main()
