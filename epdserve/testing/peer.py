"""A receiver in its own process: it owns a receive pool, offers slots and checks commits.

Used by the transfer benchmark, the demo and the two-process tests. It speaks over a
``multiprocessing`` pipe (control only; bytes move through the transport under test):

    ("reserve", rows, width, dtype)            -> ("reserved", generation, {transport: offer JSON})
    ("commit", commit JSON, seed | None)       -> ("accepted", byte_exact | None)
                                                  or ("rejected", reason)
    ("stats",)                                 -> ("stats", pool stats)
    ("raw_done", seed | None)                  -> ("ok", byte_exact | None)  # bare-engine path
    ("stop",)                                  -> ("stopped", pool stats)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass

from epdserve.wire.offers import DEFAULT_TRANSPORTS

PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}  # no OpenMP spin-wait: it starves co-located processes


@dataclass(frozen=True)
class PeerConfig:
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    pool_bytes: int = 256 << 20
    slot_bytes: int = 1 << 20
    quarantine_s: float = 30.0


def pattern(rows: int, width: int, dtype: str, seed: int):
    """Deterministic test embeddings, equal in every process for the same arguments."""
    import torch

    from epdserve.data_plane.dtypes import dtype_from_wire

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=generator).to(dtype_from_wire(dtype))


def _serve(conn, config: PeerConfig) -> None:
    import torch

    from epdserve.data_plane.commit import Commit, EmbeddingLayout, accept_commit
    from epdserve.data_plane.pool import MemoryRegion, SlotPool
    from epdserve.data_plane.transport import build_transports

    region = MemoryRegion.shared(config.pool_bytes)
    pool = SlotPool(region, config.slot_bytes, config.quarantine_s)
    transports = build_transports(config.transports)
    for transport in transports.values():
        transport.register(region)
    conn.send(("ready", os.getpid()))
    current = None  # (lease, layout)
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "reserve":
                _, rows, width, dtype = message
                layout = EmbeddingLayout(rows, width, dtype)
                lease = pool.lease(layout.nbytes)
                current = (lease, layout)
                offers = {name: t.offer(pool, lease).model_dump() for name, t in transports.items()}
                conn.send(("reserved", lease.generation, offers))
            elif kind == "commit":
                _, commit_json, seed = message
                lease, layout = current
                try:
                    rows = accept_commit(
                        pool,
                        lease,
                        layout,
                        Commit.model_validate(commit_json),
                        require_checksum=False,
                    )  # measures both variants
                except ValueError as exc:
                    pool.quarantine(lease)
                    conn.send(("rejected", str(exc)))
                    continue
                exact = None
                if seed is not None:
                    exact = bool(
                        torch.equal(rows, pattern(layout.rows, layout.width, layout.dtype, seed))
                    )
                pool.release(lease)
                conn.send(("accepted", exact))
            elif kind == "stats":
                conn.send(("stats", pool.stats()))
            elif kind == "raw_done":  # no commit to check; the rows are held as a commit's are
                _, seed = message
                lease, layout = current
                rows = pool.view(lease).view(layout.torch_dtype).view(layout.rows, layout.width)
                exact = None
                if seed is not None:
                    exact = bool(
                        torch.equal(rows, pattern(layout.rows, layout.width, layout.dtype, seed))
                    )
                pool.release(lease)
                conn.send(("ok", exact))
            elif kind == "stop":
                conn.send(("stopped", pool.stats()))
                return
    finally:
        region.close()


def _main(conn, config: PeerConfig) -> None:
    try:
        _serve(conn, config)
    except BaseException:
        conn.send(("crashed", traceback.format_exc()))
        raise


def start_peer(config: PeerConfig = PeerConfig()):
    """Spawn a receiver; returns (process, connection) once its pool is ready."""
    os.environ.update(PASSIVE_ENV)
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_main, args=(child, config), daemon=True)
    process.start()
    child.close()  # so a dead receiver reads as EOF here, not as a hang
    if not parent.poll(60):
        process.kill()
        raise RuntimeError("receiver did not become ready within 60 s")
    reply = parent.recv()
    if reply[0] != "ready":
        process.join(5)
        raise RuntimeError(f"receiver failed to start: {reply[1]}")
    return process, parent


def stop_peer(process, conn) -> dict:
    conn.send(("stop",))
    reply = conn.recv()
    process.join(10)
    return reply[1]
