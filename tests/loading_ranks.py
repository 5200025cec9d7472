"""Two real processes as one engine's tensor-parallel ranks (a gloo group, as vLLM's CPU ranks
have): each runs the connector's worker half over a real /dev/shm pool. Used by
tests/test_vllm_connector.py: ``run_ranks`` returns what each rank ended with."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import torch

WIDTH = 128
cpu = torch.device("cpu")


def _rank(index: int, size: int, init_file: str, loads, scenarios, results) -> None:
    """One rank: for each scenario (the set of ranks on another node, another /dev/shm), load
    ``loads`` (a list of steps, each a list of ``Load``) into an encoder cache of its own, with a
    connector worker half of its own."""
    import torch.distributed as dist

    from prefill_side.vllm_connector import worker

    here = worker.namespace_id
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=index, world_size=size)
    group = worker.LoadingGroup(index, tuple(range(size)), dist.group.WORLD, dist.group.WORLD)
    outcomes = []
    try:
        for elsewhere in scenarios:
            # the one thing faked: which node this process is on
            worker.namespace_id = (lambda: "another-node") if index in elsewhere else here
            outcomes.append(_load(worker.WorkerSide(WIDTH, torch.float32, cpu, group), loads))
    finally:
        dist.destroy_process_group()
    results.put((index, outcomes))


def _load(side, loads) -> dict:
    cache: dict[str, torch.Tensor] = {}
    outcome: dict = {"errors": []}
    try:
        for step in loads:
            try:
                side.load(step, cache)
            except Exception as exc:  # noqa: BLE001 - reported to the test, per step
                outcome["errors"].append(f"{type(exc).__name__}: {exc}")
        # by value (numpy pickles its bytes): a torch tensor would go as a file descriptor that
        # this process serves, and it may have exited when the test reads the queue
        outcome["cache"] = {key: value.numpy().copy() for key, value in cache.items()}
        outcome["loaded"] = side.take_loaded().load_ids
    except Exception:  # noqa: BLE001 - the test shows the rank's traceback
        outcome["traceback"] = traceback.format_exc()
    finally:
        side.close()
    return outcome


def run_ranks(loads, scenarios, size: int = 2, timeout_s: float = 120) -> list[list[dict]]:
    """Per scenario (the ranks on another node), each rank's outcome (``cache``, ``loaded``,
    ``errors`` per failed step), by rank index; one process per rank runs every scenario."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_file = f"/tmp/epd-ranks-{os.getpid()}-{os.urandom(4).hex()}"
    processes = [
        context.Process(target=_rank, args=(index, size, init_file, loads, scenarios, results))
        for index in range(size)
    ]
    for process in processes:
        process.start()
    try:
        outcomes = dict(results.get(timeout=timeout_s) for _ in processes)
        for process in processes:
            process.join(timeout_s)
            assert process.exitcode == 0, f"rank process exited {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    for index, per_scenario in outcomes.items():
        for outcome in per_scenario:
            assert "traceback" not in outcome, f"rank {index}:\n{outcome['traceback']}"
            outcome["cache"] = {
                key: torch.from_numpy(rows) for key, rows in outcome["cache"].items()
            }
    return [
        [outcomes[index][scenario] for index in range(size)] for scenario in range(len(scenarios))
    ]
