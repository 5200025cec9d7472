"""The connector's own HTTP port (``http_port``) in the process vLLM's scheduler runs in:
``/metrics`` (the receiver's Prometheus families; vLLM's ``/metrics`` is served by its API server
process, which does not see this one's registries) and ``/v1/engine`` (``EngineDescription``: the
model this engine runs, for a gateway in front of it). A threaded WSGI server on a daemon thread,
as prometheus-client serves its own: nothing here runs on the receiver's event loop."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from epdserve.wire.fingerprint import EngineDescription

ENGINE_PATH = "/v1/engine"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):
        """Requests are not logged (scrapes and probes)."""


class ConnectorHttp:
    """Serves ``/metrics`` and ``/v1/engine`` on ``host``:``port`` until ``close``; ``OSError``
    when the port cannot be bound."""

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, description: EngineDescription
    ):
        metrics = make_wsgi_app(registry)
        document = description.model_dump_json().encode()

        def app(environ, start_response):
            if environ.get("PATH_INFO") == ENGINE_PATH:
                if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
                    start_response("405 Method Not Allowed", [("Allow", "GET")])
                    return [b""]
                start_response(
                    "200 OK",
                    [("Content-Type", "application/json"), ("Content-Length", str(len(document)))],
                )
                return [document]
            return metrics(environ, start_response)

        _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.server = make_server(host, port, app, _Server, handler_class=_Quiet)
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="epd-connector-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
