"""`epd-bench transfer`: one embedding's bytes from a send region into a receiver's slot, per path,
side by side in one run (rounds interleaved, median per path).

Paths: ``memcpy`` (in-process copy, the ceiling); ``shm`` (this project's SHM transport into a
receiver in another process, until the receiver holds the slot as a tensor); two bare-engine
baselines, each with the same control round trip and no project code: ``mooncake_raw`` (the
engine's ``transfer_sync_write``, which busy-spins until done) and ``mooncake_raw_poll`` (the
engine driven as ``data_plane.mooncake`` drives it: ``transfer_submit_write``, then
``transfer_check_status`` with the same growing sleeps between polls); ``mooncake`` (this project's
transport plus its commit), compared with the better of the two bare baselines at each size;
``loopback`` (in-process transport plus commit). ``+checksum`` variants add the xxh3-64 checksum
the sender computes and the receiver verifies, to show what it costs.
"""

from __future__ import annotations

import statistics
import time

import torch

from epdserve.bench.benchmarks.results import write_json
from epdserve.testing.peer import PeerConfig, pattern, start_peer, stop_peer

PATHS = (
    "memcpy",
    "shm",
    "shm+checksum",
    "mooncake_raw",
    "mooncake_raw_poll",
    "mooncake",
    "mooncake+checksum",
    "loopback",
)
BARE = ("mooncake_raw", "mooncake_raw_poll")
ROUNDS = {1 << 20: 30, 16 << 20: 15, 128 << 20: 7}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text[-1:] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def shape_for(size: int) -> tuple[int, int]:
    """bf16 [rows, width] of exactly ``size`` bytes, width up to 4096 (a real LLM width)."""
    width = min(4096, max(1, size // 2))
    if size % (2 * width):
        raise ValueError(f"size {size} must be a multiple of {2 * width} bytes")
    return size // (2 * width), width


class TransferBench:
    def __init__(self, max_size: int):
        from epdserve.data_plane.loopback import LoopbackTransport
        from epdserve.data_plane.pool import MemoryRegion, SlotPool
        from epdserve.data_plane.transport import build_transports

        pool_bytes = max_size + (1 << 20)
        self.process, self.peer = start_peer(PeerConfig(("shm", "mooncake"), pool_bytes=pool_bytes))
        self.transports = build_transports(("shm", "mooncake"))
        self.send_region = MemoryRegion.anonymous(max_size)
        self.transports["mooncake"].register(self.send_region)
        self.copy_dst = MemoryRegion.anonymous(max_size)
        self.loopback = LoopbackTransport()
        self.loop_pool = SlotPool(MemoryRegion.anonymous(pool_bytes), 1 << 20, quarantine_s=30)
        self.loopback.register(self.loop_pool.region)

    def close(self) -> dict:
        stats = stop_peer(self.process, self.peer)
        self.transports["shm"].close()
        return stats

    def _reserve(self, rows, width):
        self.peer.send(("reserve", rows, width, "bfloat16"))
        _, generation, offers = self.peer.recv()
        return generation, offers

    def run(self, path: str, payload: torch.Tensor, seed: int | None) -> tuple[float, bool | None]:
        """One round of ``path``; returns (seconds, byte_exact or None when not checked)."""
        from epdserve.data_plane.commit import EmbeddingLayout, accept_commit, make_commit
        from epdserve.wire.offers import MooncakeOffer, ShmOffer

        nbytes = payload.numel() * 2
        src = self.send_region.tensor[:nbytes]
        rows, width = payload.shape
        if path == "memcpy":
            dst = self.copy_dst.tensor[:nbytes]
            start = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - start, bool(
                torch.equal(dst, src)
            ) if seed is not None else None
        if path == "loopback":
            layout = EmbeddingLayout(rows, width, "bfloat16")
            lease = self.loop_pool.lease(nbytes)
            offer = self.loopback.offer(self.loop_pool, lease)
            start = time.perf_counter()
            self.loopback.submit(src, offer, time.monotonic() + 60).wait()
            got = accept_commit(
                self.loop_pool,
                lease,
                layout,
                make_commit(payload, lease.generation, False),
                require_checksum=False,
            )
            elapsed = time.perf_counter() - start
            exact = bool(torch.equal(got, payload)) if seed is not None else None
            self.loop_pool.release(lease)
            return elapsed, exact
        generation, offers = self._reserve(rows, width)
        if path in BARE:
            engine = self.transports["mooncake"].engine
            offer = offers["mooncake"]
            start = time.perf_counter()
            if path == "mooncake_raw":
                rc = engine.transfer_sync_write(
                    offer["session"], src.data_ptr(), offer["address"], nbytes
                )
            else:
                rc = _submit_and_poll(
                    engine, offer["session"], src.data_ptr(), offer["address"], nbytes
                )
            self.peer.send(("raw_done", seed))
            _, exact = self.peer.recv()
            elapsed = time.perf_counter() - start
            if rc != 0:
                raise RuntimeError(f"{path}: the engine answered {rc}")
            return elapsed, exact
        name, with_checksum = path.split("+")[0], path.endswith("+checksum")
        offer = (MooncakeOffer if name == "mooncake" else ShmOffer).model_validate(offers[name])
        start = time.perf_counter()
        transfer = self.transports[name].submit(src, offer, time.monotonic() + 60)
        commit = make_commit(
            payload, generation, with_checksum
        )  # overlaps an in-flight Mooncake write
        if transfer.wait().value != "done":
            raise RuntimeError(f"{path} transfer failed: {transfer.error}")
        self.peer.send(("commit", commit.model_dump(), seed))
        kind, exact = self.peer.recv()
        elapsed = time.perf_counter() - start
        if kind != "accepted":
            raise RuntimeError(f"{path} commit rejected: {exact}")
        return elapsed, exact


def _submit_and_poll(engine, session: str, src: int, dst: int, nbytes: int) -> int:
    """One write the way ``data_plane.mooncake`` drives the engine, without its deadline, retry and
    settling bookkeeping: submit, then poll with ``Transfer.wait``'s sleeps (50 us to 1 ms, growing
    with the time waited). 0 when done, else the engine's error."""
    batch_id = engine.transfer_submit_write(session, src, dst, nbytes)
    if batch_id < 0:
        return batch_id
    started = time.monotonic()
    while (status := engine.transfer_check_status(batch_id)) == 0:
        time.sleep(min(1e-3, max(5e-5, (time.monotonic() - started) / 16)))
    return 0 if status == 1 else status


def run(sizes: list[int], paths=PATHS, rounds: int | None = None, progress=print) -> dict:
    bench = TransferBench(max(sizes))
    results = []
    try:
        for size in sizes:
            rows, width = shape_for(size)
            seed = size % 9973
            payload = pattern(rows, width, "bfloat16", seed)
            bench.send_region.tensor[:size].copy_(payload.view(-1).view(torch.uint8))
            count = rounds or ROUNDS.get(size, 10)
            times = {path: [] for path in paths}
            for path in paths:  # warm-up: first connection, first mapping
                bench.run(path, payload, None)
            for _ in range(count):
                for path in paths:
                    times[path].append(bench.run(path, payload, None)[0])
            for path in paths:
                _, exact = bench.run(path, payload, seed)  # a checked round, untimed
                median = statistics.median(times[path])
                results.append(
                    {
                        "path": path,
                        "size_bytes": size,
                        "gbps_median": size / median / 1e9,
                        "byte_exact": exact,
                        "rounds": count,
                    }
                )
                progress(
                    f"  {path:18s} {size >> 20:5d} MiB  {size / median / 1e9:6.2f} GB/s  "
                    f"exact={exact}"
                )
    finally:
        receiver_pool = bench.close()
    return {"results": results, "receiver_pool_after": receiver_pool}


def ratios(report: dict) -> list[dict]:
    """Per size: the project's paths over their baselines; Mooncake's over each bare-engine path
    and over the better of the two (``best_bare`` names it)."""
    by = {(r["path"], r["size_bytes"]): r["gbps_median"] for r in report["results"]}
    out = []
    for size in sorted({r["size_bytes"] for r in report["results"]}):
        row = {"size_bytes": size}
        bare = [path for path in BARE if (path, size) in by]
        if bare:
            row["best_bare"] = max(bare, key=lambda path: by[(path, size)])
            by[("best_bare", size)] = by[(row["best_bare"], size)]
        for num, den in (
            ("shm", "memcpy"),
            ("mooncake", "best_bare"),
            ("mooncake", "mooncake_raw"),
            ("mooncake", "mooncake_raw_poll"),
            ("shm+checksum", "memcpy"),
            ("mooncake+checksum", "best_bare"),
        ):
            if (num, size) in by and (den, size) in by:
                row[f"{num}/{den}"] = by[(num, size)] / by[(den, size)]
        out.append(row)
    return out


def main(args) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"epd-bench transfer: sizes {args.sizes}, bf16, receiver in a separate process")
    report = run(sizes, rounds=args.rounds)
    report["ratios"] = ratios(report)
    print("\nratios (median GB/s over median GB/s, same run):")
    rows = report["ratios"]
    print(f"  {'':32s}" + "".join(f"{row['size_bytes'] >> 20:>14d} MiB" for row in rows))
    for name in dict.fromkeys(k for row in rows for k, v in row.items() if isinstance(v, float)):
        print(
            f"  {name:32s}"
            + "".join(f"{row[name]:18.2f}" if name in row else f"{'-':>18s}" for row in rows)
        )
    print(
        f"  {'best bare engine path':32s}"
        + "".join(f"{row.get('best_bare', '-'):>18s}" for row in rows)
    )
    write_json(args.json, report)
    return 0 if all(r["byte_exact"] for r in report["results"]) else 1
