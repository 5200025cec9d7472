"""A local HTTP server for image URLs in the gateway's tests: serves given files by path, and
``/redirect/N`` redirects N times before ``/a.png``."""

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
