"""Running the handshake app: ``epd-handshake`` (standalone) and an in-thread server for
embedding."""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import ClassVar

import uvicorn
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from epdserve.bearer_auth import BearerAuth
from epdserve.loop_threads import LoopThread
from epdserve.process_settings import Port, PositiveByteSize, SettingError, check_listen, refuse
from epdserve.process_settings.groups import ClosedListener
from epdserve.process_settings.secrets import (
    HANDSHAKE_TOKEN_ENV,
    HANDSHAKE_TOKEN_FILE_ENV,
    HandshakeToken,
)
from epdserve.wire.addresses import DEFAULT_BOOTSTRAP_PORT, Endpoint
from epdserve.wire.room_signatures import is_loopback
from epdserve.wire.rooms import MAX_FRAME_BYTES
from handshake.app import MAX_BODY_BYTES, HandshakeAPI, create_app
from handshake.rooms import RoomTable
from handshake.settings import RoomTableSettings

log = logging.getLogger(__name__)


# No access log, no Server/Date headers, no X-Forwarded-* rewriting: per-request work we do not use.
# Idle keep-alive connections stay open 65 s, longer than our clients keep them (30 s): with
# uvicorn's default 5 s, a client reusing a connection just as the server closed it got "Server
# disconnected", and a mint (never retried) failed.
UVICORN_OPTIONS = dict(
    log_level="warning",
    access_log=False,
    server_header=False,
    date_header=False,
    proxy_headers=False,
    timeout_keep_alive=65,
    ws_max_size=MAX_FRAME_BYTES,  # a room-stream frame
)


def _guarded(app) -> bool:
    """Whether ``app``'s ``/v1`` routes need a bearer token: the handshake app's own, or
    ``BearerAuth`` with a token in its middleware."""
    if isinstance(app, HandshakeAPI):
        return app.token is not None
    return any(
        m.cls is BearerAuth and m.kwargs.get("token") for m in getattr(app, "user_middleware", ())
    )


def open_listener_warning(app, host: str) -> str | None:
    """The warning a listener deserves when anyone who reaches it may use it: bound beyond loopback
    (``--insecure-listen``) and without a token. None when it is bound to loopback or needs a
    token."""
    if is_loopback(host) or _guarded(app):
        return None
    remedy = (
        f"set a bearer token (--token-file, ${HANDSHAKE_TOKEN_FILE_ENV} or "
        f"${HANDSHAKE_TOKEN_ENV}; the gateway's --api-key-file) or keep the port private"
    )
    return (
        f"INSECURE: {app.title} listens on {host} and takes requests from anyone who reaches the "
        "port, "
        f"with no token; {remedy} (a NetworkPolicy, or bind 127.0.0.1)"
    )


def _warn_if_open(app, host: str) -> None:
    warning = open_listener_warning(app, host)
    if warning is not None:
        log.warning(warning)


class _Announcing(uvicorn.Server):
    """A uvicorn server that calls ``ready()`` once its listener accepts connections."""

    def __init__(self, config: uvicorn.Config, ready: Callable[[], None] | None):
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._ready is not None:
            self._ready()


def serve(
    app, host: str, port: int, graceful_s: float = 5.0, ready: Callable[[], None] | None = None
) -> None:
    """uvicorn in this (main) thread until SIGTERM / SIGINT, then a graceful shutdown and a normal
    return, so the caller's clean-up runs and the process exits 0 (uvicorn re-raises the signal
    after its shutdown; the handlers installed here absorb it). Warns first if the listener is open
    to anyone (``open_listener_warning``); ``ready()`` (the process's "ready" line) is called
    once the listener accepts connections, not before."""
    _warn_if_open(app, host)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=graceful_s, **UVICORN_OPTIONS
    )
    _Announcing(config, ready).run()


class ThreadedServer:
    """A real uvicorn server on an event-loop thread (the encode worker's bootstrap port, tests).
    An embedding process may pass its own ``LoopThread``, to run its room work on the server's
    loop (the encode worker's sender does): then ``stop`` leaves that loop running."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, loop: LoopThread | None = None):
        _warn_if_open(app, host)
        config = uvicorn.Config(
            app, host=host, port=port, lifespan="on", timeout_graceful_shutdown=2, **UVICORN_OPTIONS
        )
        self.server = uvicorn.Server(config)
        self.host = host
        self.loop = loop or LoopThread("handshake-server")
        self._owns_loop = loop is None
        self._serving = None

    def start(self, timeout_s: float = 10.0) -> ThreadedServer:
        self._serving = self.loop.submit(self.server.serve())
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if self._serving.done() or time.monotonic() > end:
                self.stop()
                raise RuntimeError("handshake server did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """This server over loopback: ``http://[::1]:port`` when it listens on IPv6, else
        127.0.0.1."""
        return Endpoint("::1" if ":" in self.host else "127.0.0.1", self.port).url("http")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._serving is not None:
            concurrent.futures.wait([self._serving], 10)
        if self._owns_loop:
            self.loop.stop(10)


class HandshakeSettings(RoomTableSettings, HandshakeToken, ClosedListener):
    """Standalone bootstrap-room handshake service."""

    model_config = SettingsConfigDict(env_prefix="EPD_HANDSHAKE_")
    PROG: ClassVar[str] = "epd-handshake"

    host: str = Field("0.0.0.0", min_length=1, description="address to listen on")
    port: Port = Field(
        DEFAULT_BOOTSTRAP_PORT, description="port of the room API, /healthz, /readyz, /metrics"
    )
    max_body_bytes: PositiveByteSize = Field(
        MAX_BODY_BYTES, description="largest accepted request body (bytes; K, M, G suffixes)"
    )

    @model_validator(mode="after")
    def _closed(self) -> HandshakeSettings:
        self.closed(self.host, {"--token-file": self.handshake_token})
        return self


def main(argv: list[str] | None = None) -> int:
    """Every setting is checked first: a mistake is one line on stderr and exit status 1."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = HandshakeSettings.from_command_line(argv)
        check_listen(settings.host, settings.port, "--port")
    except SettingError as exc:
        return refuse(HandshakeSettings.PROG, exc)
    token = settings.handshake_token
    app = create_app(
        RoomTable(settings.room_limits()), token=token, max_body_bytes=settings.max_body_bytes
    )
    serve(
        app,
        settings.host,
        settings.port,
        ready=lambda: log.info(
            "epd-handshake serving rooms on http://%s:%d (room API /v1/rooms, /healthz, /readyz, "
            "/metrics; bearer token %s)",
            settings.host,
            settings.port,
            "required" if token else "off",
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
