"""Local HTTP servers for the gateway's tests: one serving image URLs (given files by path, and
``/redirect/N`` redirecting N times before ``/a.png``), and an attacker's endpoint recording
whatever it is sent."""

import contextlib
import http.server
import threading

from epdserve.testing.cluster import HOST


@contextlib.contextmanager
def serving(files: dict[str, tuple[str, bytes]]):
    """``files``: path -> (content type, body); yields the server's base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/redirect/"):
                left = int(self.path.rsplit("/", 1)[1])
                self.send_response(302)
                self.send_header("Location", f"/redirect/{left - 1}" if left > 1 else "/a.png")
                self.end_headers()
                return
            kind, body = files.get(self.path, ("text/plain", b"not found"))
            self.send_response(200 if self.path in files else 404)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return

    server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def recording():
    """A server that answers every request 404 and records each one (method, path, headers): an
    attacker's endpoint. Yields (its port, the list of what it was sent)."""
    seen: list[tuple[str, str, dict]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _record(self):
            seen.append((self.command, self.path, dict(self.headers)))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _record

        def log_message(self, *args):
            return

    server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
