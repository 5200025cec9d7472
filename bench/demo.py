"""`make demo`: the data plane on this machine, end to end for one embedding per transport.

A receiver process reserves a slot in its registered pool; this process writes an image
embedding's rows into it over Mooncake (TCP here, RDMA where there is an HCA), over same-node SHM,
and in-process over loopback; the receiver checks the commit (generation, rows x width x dtype,
checksum) and compares every byte. Until the encode worker and prefill side exist, this is the
demo.
"""

from __future__ import annotations

import glob
import os
import sys
import time

from bench.transfer import TransferBench

# One Qwen2.5-VL-7B image at 1344x1344: 2304 rows x 3584 wide, bf16 (16.5 MB).
DEMO_ITEMS = [("1344px image, Qwen2.5-VL-7B width", 2304, 3584), ("448px image, Qwen2.5-VL-7B width", 256, 3584)]
PATHS = ("mooncake+checksum", "shm+checksum", "loopback")


def main() -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from bench.peer import pattern

    before = set(glob.glob("/dev/shm/epd-*"))
    largest = max(rows * width * 2 for _, rows, width in DEMO_ITEMS)
    print("Starting a receiver process (the prefill side's registered receive pool)...")
    bench = TransferBench(largest)
    ok = True
    try:
        print(f"\n{'item':36s} {'rows x width':>13s} {'MB':>6s}  {'path':18s} {'ms':>7s} {'GB/s':>6s}  byte-exact")
        for seed, (label, rows, width) in enumerate(DEMO_ITEMS, start=1):
            payload = pattern(rows, width, "bfloat16", seed)
            nbytes = payload.numel() * 2
            bench.send_region.tensor[:nbytes].copy_(payload.view(-1).view(torch.uint8))
            for path in PATHS:
                bench.run(path, payload, None)  # first contact: connection set-up, segment mapping
                seconds, _ = bench.run(path, payload, None)
                _, exact = bench.run(path, payload, seed)  # the receiver compares every byte
                ok &= bool(exact)
                print(f"{label:36s} {f'{rows} x {width}':>13s} {nbytes / 1e6:6.1f}  {path:18s} "
                      f"{seconds * 1e3:7.2f} {nbytes / seconds / 1e9:6.2f}  {exact}")
    finally:
        stats = bench.close()
    time.sleep(0.2)
    left = set(glob.glob("/dev/shm/epd-*")) - before
    print(f"\nreceiver pool at exit: {stats['leased_slots']} slots leased, {stats['quarantined_slots']} quarantined")
    print(f"SHM segments left behind: {len(left)}")
    print("(ms: write + commit round trip + the receiver's checks; the byte comparison ran in a separate round)")
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
