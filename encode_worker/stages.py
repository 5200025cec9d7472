"""The encode worker's stages, one job and one thread each, joined by bounded queues
(``encode_worker.messages`` says what travels and who writes which field):

* ``Intake`` (``intake_stage``): the ZMQ ROUTER loop; validates each message into an
  ``EncodeJob`` from what it can see without decoding, queues it, and answers at once with an
  ``IntakeReply``.
* ``Prepare`` (``prepare``): takes a batch from the ``BatchQueue``; cache hits skip the tower, and
  so does an item identical to one in flight (``InFlightEncodes``: it waits for that item's rows);
  the rest are decoded (an image, or a video's sampled frames) and preprocessed by the
  checkpoint's image or video processor. Images and videos share batches and tower calls.
* ``TowerStage`` (``tower_stage``): one tower call per batch, rows split per item, cached and
  handed to the items that waited for them; a batch that fails is retried item by item, so a bad
  item fails only its room (and those of the items waiting for it).
* ``StageAndSend`` (``staging``): copies each item's rows into the send ring and hands it to the
  ``Sender``.

Decoding the next batch and staging the last one overlap the tower. A full send ring blocks
StageAndSend, which fills the hand-offs behind it, which stops Prepare pulling from the queue,
which makes intake refuse ("queue full"): backpressure, all the way to the dispatcher.

Each stage is built from the ``StageContext`` the worker makes once (what the stages share), and
takes from it the parts it needs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from encode_worker.cache import InFlightEncodes
    from encode_worker.config import WorkerConfig
    from encode_worker.device import TowerDevice
    from encode_worker.health import Health
    from encode_worker.metrics import WorkerMetrics
    from encode_worker.room_clients import RoomFailer
    from encode_worker.scheduler import BatchQueue
    from epdserve.vision.tower import VisionTower

SHUTTING_DOWN = "encode worker shutting down"
# The process's intra-op threads as the environment set them, read before any stage sets its own.
PROCESS_TORCH_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class StageThreads:
    """Torch's intra-op threads for each stage's thread, set by each stage at its start (torch's
    count is one for the process: the last ``set_num_threads`` is what a thread's first op takes,
    so each stage sets its own). The preprocessing pool's threads take one each."""

    prepare: int
    tower: int
    stage: int

    @classmethod
    def for_device(cls, device: TowerDevice) -> StageThreads:
        cores = PROCESS_TORCH_THREADS
        if device.is_cuda:
            # The tower thread only queues GPU work, and preprocessing in one thread takes one:
            # an H100 host's 16 intra-op threads around ~5 ms of preprocessing burned ~30 ms of
            # CPU per image (docs/performance.md).
            return cls(prepare=1, tower=1, stage=cores)
        # Beside a CPU tower, preprocessing shares the cores with it (one thread there cost a
        # fifth of batched items/s on 2 cores, docs/performance.md).
        return cls(prepare=cores, tower=cores, stage=cores)


@dataclass(frozen=True)
class StageContext:
    """What the stages share, made once by the worker: its settings, the tower and its device,
    the batching queue, identical items in flight, the room failer, health, metrics, each stage's
    torch threads, and the stop signal."""

    config: WorkerConfig
    tower: VisionTower
    device: TowerDevice
    queue: BatchQueue
    encodes: InFlightEncodes
    failer: RoomFailer
    health: Health
    metrics: WorkerMetrics
    threads: StageThreads
    stopping: threading.Event
