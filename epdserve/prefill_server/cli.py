"""``epd-prefill``'s start: every setting checked first (a mistake is one line on stderr and exit
status 1), the tower loaded, the receive pool reserved, then the app served until SIGTERM."""

from __future__ import annotations

import os
from typing import NoReturn

from epdserve.prefill_server.settings import PrefillSettings
from epdserve.process_settings import (
    SettingError,
    exit_process,
    refuse,
)


def _start(settings: PrefillSettings):
    """Check every setting, load the tower, reserve the pool: ``(receiver, tower)``, or
    ``SettingError`` with the one line to print. The checks that need no torch run before it is
    imported: such a refusal takes a fraction of a second."""
    from epdserve.process_settings import (
        check_checkpoint,
        check_listen,
        check_memory,
        check_shm_space,
    )
    from epdserve.wire.offers import transport_spec

    check_listen(settings.host, settings.port, "--port")
    check_memory(settings.pool_bytes, "--pool-bytes")
    # with a transport that does not need it (Mooncake), a full /dev/shm falls back to process
    # memory
    if all(transport_spec(name).needs_shm_pool for name in settings.transports):
        check_shm_space(settings.pool_bytes, "--pool-bytes")
    tower = fingerprint = None
    width, deepstack = settings.width, settings.deepstack_width
    if settings.model:
        directory = check_checkpoint(settings.model)
        from epdserve.prefill_server.app import TowerCalls
        from epdserve.vision.fingerprint import tower_fingerprint
        from epdserve.vision.tower import TowerLoadError, VisionTower

        try:
            tower = TowerCalls(
                VisionTower.load(
                    directory, settings.dtype, processor_kwargs=settings.mm_processor_kwargs
                ),
                settings.tower_calls,
            )
        except (TowerLoadError, OSError, ValueError) as exc:
            raise SettingError(
                f"--model {settings.model}: cannot load the vision tower: {exc}"
            ) from None
        for flag, given, own in (
            ("--width", width, tower.info.wire_width),
            ("--deepstack-width", deepstack, tower.info.out_width * tower.info.deepstack_levels),
        ):
            if given and given != own:
                raise SettingError(
                    f"{flag} {given} differs from the checkpoint's ({own}); leave it out"
                )
        width, deepstack = tower.info.wire_width, tower.info.out_width * tower.info.deepstack_levels
        # its own model: rooms registered with it, rows committed under another refused
        fingerprint = tower_fingerprint(tower.tower).compact
    if width <= 0:
        raise SettingError("give --width (or --model to read it from the checkpoint)")
    if deepstack >= width:
        raise SettingError(
            f"--deepstack-width {deepstack} leaves no main embedding in rows of {width}"
        )
    from epdserve.data_plane.shm import ShmError
    from epdserve.data_plane.transport import TransportUnavailable, build_transports
    from prefill_side import PrefillReceiver, ReceiverConfig

    try:
        config = ReceiverConfig(
            **settings.receiver_settings(),
            width=width,
            dtype=settings.dtype,
            deepstack_width=deepstack,
            fallback=settings.fallback,
            handshake_token=settings.handshake_token,
            model_fingerprint=fingerprint,
        )
        # Mooncake advertises the address encode workers reach (the pod IP), not loopback.
        configs = settings.transport_configs(settings.mooncake_host)
        receiver = PrefillReceiver(
            config,
            build_transports(config.transports, configs, optional=True),
            local_tower=tower,
        )
    except (TransportUnavailable, ShmError, ValueError) as exc:  # no usable transport or pool
        raise SettingError(f"cannot start: {exc}") from None
    return receiver, tower


def main(argv: list[str] | None = None) -> NoReturn:
    """Every setting is checked first: a mistake is one line on stderr and exit status 1. The
    process ends through ``exit_process`` either way."""
    import logging

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = PrefillSettings.from_command_line(argv)
        receiver, tower = _start(settings)
    except SettingError as exc:
        exit_process(refuse(PrefillSettings.PROG, exc))
    from epdserve.prefill_server.app import create_app
    from handshake.server import serve

    config = receiver.config
    try:
        app = create_app(receiver, tower, settings.max_body_bytes, settings.served_model_name)
        serve(
            app,
            settings.host,
            settings.port,
            ready=lambda: logging.getLogger("epd-prefill").info(
                "epd-prefill ready: http://%s:%d (/v1/prefill, /healthz, /readyz, /metrics); "
                "rows of %d x %s; transports %s (Mooncake host %s); local tower %s",
                settings.host,
                settings.port,
                config.width,
                config.dtype,
                ",".join(receiver.transports),
                settings.mooncake_host,
                settings.model or "none",
            ),
        )
    finally:
        receiver.close()
    exit_process(0)


if __name__ == "__main__":
    main()
