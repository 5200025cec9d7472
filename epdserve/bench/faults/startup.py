"""Start-up fault scenarios, in processes of their own: an epd-prefill whose /dev/shm has less
room than its pool (a private mount namespace with a small tmpfs), and an encode worker and
prefill processes that start while Mooncake cannot initialize (its port range taken).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import socket
import time
from typing import TYPE_CHECKING

from epdserve.bench.faults.lab import FaultOutcome
from epdserve.bench.faults.scenario_steps import serves

if TYPE_CHECKING:
    from epdserve.bench.faults.lab import Conn, FaultLab
    from epdserve.testing.cluster import Role


def start_with_small_dev_shm(
    lab: FaultLab, name: str, transports: str, shm_bytes: int = 8 << 20
) -> Role:
    """An epd-prefill in a private mount namespace whose /dev/shm is a ``shm_bytes`` tmpfs, smaller
    than its pool: creating the pool gets a real ENOSPC from posix_fallocate."""
    if shutil.which("unshare") is None:
        raise RuntimeError("unshare(1) is not installed")
    prefix = (
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec "$@"',
        "sh",
    )
    return lab.track(
        lab.cluster.start_prefill(
            name,
            transports=transports,
            pool_bytes=32 << 20,
            extra=("--slot-bytes", str(lab.config.slot_bytes)),
            prefix=prefix,
        )
    )


@contextlib.contextmanager
def mooncake_ports_taken():
    """Every port Mooncake may use is held by another socket: ``initialize`` fails (rc -1), as it
    does when a pod's pinned Mooncake range is already in use. Yields the environment to start a
    process with."""
    holder = socket.socket()
    for port in random.sample(
        range(15000, 17000), 2000
    ):  # Mooncake ignores a range outside its own
        try:
            holder.bind(("0.0.0.0", port))
            break
        except OSError:
            continue
    else:
        holder.close()
        raise RuntimeError("no free port in 15000..17000 to hold")
    holder.listen()
    try:
        yield {"MC_MIN_RPC_PORT": str(port), "MC_MAX_RPC_PORT": str(port)}
    finally:
        holder.close()


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    import subprocess

    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=1m tmpfs /dev/shm",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


def _log(role: Role) -> str:
    with open(role.log_path, errors="replace") as f:
        return f.read()


async def _wait_exit(lab: FaultLab, role: Role, timeout_s: float = 90) -> int | None:
    """Until a role that should fail at start-up exits; None (and the process killed) if it did
    not."""
    end = time.monotonic() + timeout_s
    while role.alive() and time.monotonic() < end:
        await asyncio.sleep(0.1)
    code = role.process.poll()
    if code is None:
        lab.cluster.kill(role)
    lab.cluster.roles.remove(role)
    return code


async def _retire(lab: FaultLab, role: Role) -> int:
    """SIGTERM a role started for one scenario; its exit code."""
    if role.alive():
        role.process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(role.process.wait, 30)
    lab.cluster.roles.remove(role)
    return code


async def dev_shm_full(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """epd-prefill starts where /dev/shm has less room than its pool (a private mount namespace
    whose /dev/shm is an 8 MiB tmpfs: creating the 32 MiB pool gets a real ENOSPC from
    posix_fallocate). Offered SHM and Mooncake, it must come up on a Mooncake-only pool and serve,
    saying why; offered SHM alone, it must exit at once with a clear error."""
    outcome = FaultOutcome("dev_shm_full")
    started = time.monotonic()
    fallback = start_with_small_dev_shm(lab, "prefill-enospc", "shm,mooncake")
    only_shm = start_with_small_dev_shm(lab, "prefill-enospc-shm-only", "shm")
    code = await _wait_exit(lab, only_shm)
    log = _log(only_shm)
    outcome.notes["shm_only_exit_code"] = code
    outcome.notes["shm_only_last_line"] = log.strip().splitlines()[-1] if log.strip() else ""
    outcome.affected.append(
        {
            "state": "FAILED" if code not in (None, 0) else "DONE",
            "reason": outcome.notes["shm_only_last_line"],
            "ttf_s": time.monotonic() - started,
        }
    )
    await asyncio.to_thread(lab.cluster.wait_ready, 120)
    outcome.notes["fallback_serves_over_mooncake"] = await serves(
        lab, conn, rng, "a", fallback, "mooncake"
    )
    log = _log(fallback)
    outcome.notes["fallback_says"] = [line for line in log.splitlines() if "No space left" in line][
        :1
    ]
    outcome.notes["fallback_exit_code"] = await _retire(lab, fallback)
    outcome.expected = (
        code not in (None, 0)
        and "No space left on device" in outcome.notes["shm_only_last_line"]
        and "Traceback" not in _log(only_shm)
        and outcome.notes["fallback_serves_over_mooncake"]
        and bool(outcome.notes["fallback_says"])
        and outcome.notes["fallback_exit_code"] == 0
    )
    return outcome


async def mooncake_unavailable(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """An encode worker and a prefill process start while Mooncake cannot initialize (its whole port
    range is taken): each must come up SHM-only, saying so, and serve over SHM; a prefill process
    offered Mooncake alone must exit at once with a clear error."""
    outcome = FaultOutcome("mooncake_unavailable")
    started = time.monotonic()
    with mooncake_ports_taken() as env:
        worker = lab.track(
            lab.cluster.start_encode_worker(
                "worker-nomc",
                transports="shm,mooncake",
                extra=("--ring-bytes", str(32 << 20)),
                env=env,
            )
        )
        prefill = lab.track(
            lab.cluster.start_prefill(
                "prefill-nomc",
                transports="shm,mooncake",
                pool_bytes=32 << 20,
                extra=("--slot-bytes", str(lab.config.slot_bytes)),
                env=env,
            )
        )
        only = lab.track(
            lab.cluster.start_prefill(
                "prefill-nomc-only", transports="mooncake", pool_bytes=32 << 20, env=env
            )
        )
        code = await _wait_exit(lab, only)
        log = _log(only)
        outcome.notes["mooncake_only_exit_code"] = code
        outcome.notes["mooncake_only_last_line"] = (
            log.strip().splitlines()[-1] if log.strip() else ""
        )
        outcome.affected.append(
            {
                "state": "FAILED" if code not in (None, 0) else "DONE",
                "reason": outcome.notes["mooncake_only_last_line"],
                "ttf_s": time.monotonic() - started,
            }
        )
        await asyncio.to_thread(lab.cluster.wait_ready, 120)
        outcome.notes["serves_over_shm"] = await serves(lab, conn, rng, worker, prefill, "shm")
        outcome.notes["worker_says"] = [
            l for l in _log(worker).splitlines() if "Mooncake unavailable" in l
        ][:1]
        outcome.notes["prefill_says"] = [
            l for l in _log(prefill).splitlines() if "Mooncake unavailable" in l
        ][:1]
        outcome.notes["exit_codes"] = [await _retire(lab, worker), await _retire(lab, prefill)]
    outcome.expected = (
        code not in (None, 0)
        and "Mooncake" in outcome.notes["mooncake_only_last_line"]
        and "Traceback" not in _log(only)
        and outcome.notes["serves_over_shm"]
        and bool(outcome.notes["worker_says"])
        and bool(outcome.notes["prefill_says"])
        and outcome.notes["exit_codes"] == [0, 0]
    )
    return outcome
