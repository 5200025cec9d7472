"""CPU per lifecycle of each process in `epd-bench handshake`'s production path (the stream
opener, receiver and sender): the server's (from /proc, after it is ready) and the bench's client
process's (the dispatcher's opens, the receiver and the sender together), one level per run, each
run with a fresh server.
Usage: PYTHONPATH=. .venv/bin/python docs/results/issue32/handshake_cpu.py OUT.json [RUNS [PATH]]
PATH: the opener's, the receiver's and the sender's ways, as in ``bench.handshake.PATHS``
(default ``stream,stream,stream``; ``rest,rest,rest``: every call over REST).
As run here: ... docs/results/issue32/handshake-cpu.json 4 (8-room lifecycles, 16 in flight, 3 s)"""

import json
import os
import subprocess
import sys
import time

from bench import handshake

BATCH, CONCURRENCY, SECONDS, WARM_LIFECYCLES = 8, 16, 3.0, 5


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(path: tuple[str, str, str]) -> dict:
    server: dict[str, float] = {}
    start_server, terminate = handshake.start_server, subprocess.Popen.terminate

    def started(port):
        process = start_server(port)
        server["ready"] = cpu_s(process.pid)
        return process

    def ended(process):
        server["end"] = cpu_s(process.pid)
        terminate(process)

    handshake.start_server, subprocess.Popen.terminate = started, ended
    handshake.PATHS, handshake.BATCHES = (path,), (BATCH,)
    try:
        client_start = time.process_time()
        report = handshake.run(SECONDS, 1, (CONCURRENCY,), progress=lambda _: None)
        client = time.process_time() - client_start
    finally:
        handshake.start_server, subprocess.Popen.terminate = start_server, terminate
    (row,) = report["levels"]
    lifecycles = row["lifecycles_per_s"] * SECONDS + WARM_LIFECYCLES
    return {
        "rooms_per_s": row["rooms_per_s"],
        "server_us_per_lifecycle": (server["end"] - server["ready"]) / lifecycles * 1e6,
        "client_us_per_lifecycle": client / lifecycles * 1e6,
    }


def main() -> None:
    out, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    path = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("stream",) * 3
    rows = [one_run(path) for _ in range(runs)]
    for row in rows:
        print({key: round(value) for key, value in row.items()})
    with open(out, "w") as f:
        json.dump(
            {
                "path": path,
                "batch": BATCH,
                "concurrency": CONCURRENCY,
                "seconds": SECONDS,
                "runs": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
