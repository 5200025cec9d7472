"""`epd-bench handshake`: full room lifecycles through the project's client against a real server.

The server (`python -m handshake.server`) runs in its own process on loopback; the client here
runs N concurrent loops of: mint -> register receiver -> commit -> receiver observes the commit
(``/v1/rooms/watch`` long-poll, the route the prefill receiver uses). Then the same with 8-room batches (one call per step for 8 rooms).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from data_plane.offers import LoopbackOffer
from handshake.client import HandshakeClient
from handshake.loops import new_event_loop
from handshake.models import CommitBody, Registration, RoomState

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    process = subprocess.Popen([sys.executable, "-m", "handshake.server", "--host", "127.0.0.1", "--port", str(port),
                                "--max-live-rooms", "200000"], env=env)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("handshake server did not start")


def _registration(room: int) -> Registration:
    return Registration(room=room, generation=1, rows=256, width=3584, dtype="bfloat16",
                        offers=[LoopbackOffer(kind="loopback", region=1, offset=0, capacity=256 * 3584 * 2)])


def _commit(room: int) -> CommitBody:
    return CommitBody(room=room, generation=1, transport="loopback", rows=256, width=3584, dtype="bfloat16",
                      checksum=12345)


async def _lifecycle(client: HandshakeClient, batch: int) -> None:
    rooms = await client.mint(batch, ttl_s=60)
    registered = await client.register([_registration(r) for r in rooms])
    versions = {r.room: r.view.version for r in registered}
    await client.commit([_commit(r) for r in rooms])
    observed = [r.view.state for r in await client.watch(versions, wait_s=5)]  # the receiver's long-poll
    if any(state is not RoomState.SUCCESS for state in observed):
        raise RuntimeError(f"lifecycle ended in {observed}")


async def _load(url: str, concurrency: int, batch: int, seconds: float) -> dict:
    client = HandshakeClient(url, timeout_s=10)
    latencies: list[float] = []
    end = time.monotonic() + seconds

    async def loop():
        while time.monotonic() < end:
            started = time.perf_counter()
            await _lifecycle(client, batch)
            latencies.append(time.perf_counter() - started)

    for _ in range(5):  # warm the connection pool
        await _lifecycle(client, batch)
    started = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    await client.close()
    latencies.sort()
    return {"concurrency": concurrency, "batch": batch, "lifecycles": len(latencies),
            "lifecycles_per_s": len(latencies) / elapsed, "rooms_per_s": len(latencies) * batch / elapsed,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3}


def run(seconds: float = 3.0, concurrency=CONCURRENCY, progress=print) -> dict:
    port = _free_port()
    server = start_server(port)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for batch in (1, 8):
            for level in concurrency:
                with asyncio.Runner(loop_factory=new_event_loop) as runner:
                    row = runner.run(_load(url, level, batch, seconds))
                rows.append(row)
                progress(f"  batch {batch}  concurrency {level:3d}  {row['lifecycles_per_s']:7.0f} lifecycles/s  "
                         f"{row['rooms_per_s']:7.0f} rooms/s  p50 {row['p50_ms']:5.1f} ms  p99 {row['p99_ms']:5.1f} ms")
    finally:
        server.terminate()
        server.wait(10)
    singles = [r for r in rows if r["batch"] == 1]
    within = [r for r in singles if r["p99_ms"] <= 20] or singles
    best = max(within, key=lambda r: r["lifecycles_per_s"])
    best8 = max((r for r in rows if r["batch"] == 8), key=lambda r: r["rooms_per_s"])
    return {"lifecycles_per_s": best["lifecycles_per_s"], "p50_ms": best["p50_ms"], "p99_ms": best["p99_ms"],
            "best_concurrency": best["concurrency"], "rooms_per_s_batch8": best8["rooms_per_s"],
            "best_concurrency_batch8": best8["concurrency"], "runs": rows}


def main(args) -> int:
    print(f"epd-bench handshake: {args.seconds:.0f} s per level; server in its own process on loopback")
    report = run(args.seconds)
    print(f"\nbest with p99 <= 20 ms: {report['lifecycles_per_s']:.0f} lifecycles/s at concurrency "
          f"{report['best_concurrency']} (p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms); "
          f"8-room batches: {report['rooms_per_s_batch8']:.0f} rooms/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0
