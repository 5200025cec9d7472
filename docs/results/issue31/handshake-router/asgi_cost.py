"""Microseconds of one process's CPU per room-API request, the handshake app called as an ASGI app
in a loop (no sockets, no HTTP parsing), and, with --layers, through each layer under it.
Usage: PYTHONPATH=<tree> .venv/bin/python asgi_cost.py {watch8|cancel1} [--layers]
  watch8: /v1/rooms/watch for 8 live rooms (answers 8 views); cancel1: /v1/rooms/cancel with a
  malformed room id (answers a 422)."""

import asyncio
import json
import statistics
import sys
import time

from handshake.app import create_app

CALLS = 20_000


async def main(call: str, layers: bool) -> None:
    app = create_app()
    if call == "watch8":
        path = "/v1/rooms/watch"
        rooms = app.state.table.mint(8, 300)
        body = json.dumps({"rooms": [{"room": r, "after_version": 0} for r in rooms]}).encode()
    else:
        path, body = "/v1/rooms/cancel", b'{"rooms": [0]}'

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        return None

    def scope():
        return {
            "type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": b"", "http_version": "1.1", "scheme": "http",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2),
        }  # fmt: skip

    targets = {"app": app}
    if layers:
        route = next(r for r in app.router.routes if getattr(r, "path", "") == path)
        app.middleware_stack = app.build_middleware_stack()

        async def handle(scope, receive, send):
            await route.handle(scope, receive, send)

        targets.update(stack=app.middleware_stack, router=app.router, route=handle)
    results = {name: [] for name in targets}
    for _ in range(5):
        for name, target in targets.items():
            for _ in range(500):
                await target(scope(), receive, send)
            started = time.perf_counter()
            for _ in range(CALLS):
                await target(scope(), receive, send)
            results[name].append((time.perf_counter() - started) / CALLS * 1e6)
    for name, runs in results.items():
        print(f"{call} {name}: median {statistics.median(runs):.1f} us per request, runs "
              + " ".join(f"{run:.1f}" for run in runs))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--layers" in sys.argv[2:]))
