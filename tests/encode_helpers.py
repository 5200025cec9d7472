"""Test-side stand-ins for the peers of an encode worker: a receiver that reserves slots and
checks commits, images and videos to send, and an in-process worker + receiver stack over
loopback."""

import asyncio
import contextlib
import io
import time

import numpy as np
import torch
from PIL import Image

from epdserve.data_plane.commit import EmbeddingLayout, accept_commit
from epdserve.data_plane.dtypes import dtype_to_wire
from epdserve.data_plane.pool import MemoryRegion, SlotPool
from epdserve.wire.rooms import Registration, RoomState


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def video_frames(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 ``[frames, height, width, 3]``: noise that changes every frame."""
    return np.random.RandomState(seed).randint(0, 255, (frames, height, width, 3), dtype=np.uint8)


def mp4(frames: int, height: int, width: int, seed: int, fps: int = 10) -> bytes:
    """An H.264 MP4 of ``video_frames(...)`` at ``fps`` (PyAV's own FFmpeg and libx264)."""
    return _encoded_video("mp4", "libx264", frames, height, width, seed, fps)


def webm(frames: int, height: int, width: int, seed: int, fps: int = 10) -> bytes:
    """A VP8 WebM of ``video_frames(...)`` at ``fps`` (PyAV's own FFmpeg and libvpx)."""
    return _encoded_video("webm", "libvpx", frames, height, width, seed, fps)


def _encoded_video(
    container_format: str, codec: str, frames: int, height: int, width: int, seed: int, fps: int
) -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in video_frames(frames, height, width, seed):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


class Receiver:
    """Reserves one slot per room in its own pool and registers it with the room's table."""

    def __init__(self, table, transports: dict, pool_bytes: int = 64 << 20):
        self.table = table
        self.transports = transports
        self.pool = SlotPool(MemoryRegion.shared(pool_bytes), 1 << 16, quarantine_s=5)
        for transport in transports.values():
            transport.register(self.pool.region)
        self.reserved = {}

    def _register(self, registration: Registration):
        return self.table.register(registration)

    def _watch(self, room: int, version: int):
        (view,) = asyncio.run(self.table.watch({room: version}, 1.0))
        return view

    def reserve(self, room: int, rows: int, width: int, dtype: torch.dtype):
        layout = EmbeddingLayout(rows, width, dtype_to_wire(dtype))
        lease = self.pool.lease(layout.nbytes)
        offers = [t.offer(self.pool, lease) for t in self.transports.values()]
        self.reserved[room] = (lease, layout)
        return self._register(
            Registration(
                room=room,
                generation=lease.generation,
                rows=rows,
                width=width,
                dtype=layout.dtype,
                offers=offers,
            )
        )

    def wait(self, room: int, timeout: float = 30.0):
        """(state, rows or None, view) once the room is terminal; ``TimeoutError`` if it is not
        within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        version = 0
        while True:
            view = self._watch(room, version)
            version = view.version
            if view.state.terminal:
                break
            if time.monotonic() >= end:
                raise TimeoutError(f"room {room} still {view.state.value} after {timeout} s")
        lease, layout = self.reserved[room]
        if view.state is RoomState.SUCCESS:
            return (
                view.state,
                accept_commit(self.pool, lease, layout, view.commit).clone(),
                view,
            )
        return view.state, None, view

    def close(self):
        for transport in self.transports.values():
            transport.unregister(self.pool.region)
        self.pool.region.close()


class RestReceiver(Receiver):
    """The same receiver, reaching the rooms over REST (the encode worker is another process)."""

    def __init__(self, client, transports: dict, pool_bytes: int = 64 << 20):
        super().__init__(None, transports, pool_bytes)
        self.client = client

    def _register(self, registration: Registration):
        (result,) = self.client.register([registration])
        return result.view

    def _watch(self, room: int, version: int):
        (result,) = self.client.watch({room: version}, 1.0)
        return result.view


def dispatch_to(worker, processor, media, request_id="req-1", **options) -> list:
    """The real ``Dispatcher`` (``options``: its own) placing ``media`` on the in-process encode
    ``worker``, from this thread: the dispatched items."""
    from epdserve.dispatcher import Dispatcher, WorkerAddress, WorkerSet

    async def run():
        workers = WorkerSet([WorkerAddress("127.0.0.1", worker.bootstrap_port, worker.intake_port)])
        await workers.refresh()
        dispatcher = Dispatcher(workers, processor, **options)
        try:
            return await dispatcher.dispatch(request_id, media)
        finally:
            await dispatcher.close()
            await workers.close()

    return asyncio.run(run())


@contextlib.contextmanager
def loopback_stack(tower, local_tower=None, worker=None, receiver=None):
    """A real encode worker and a real ``PrefillReceiver`` in this process, joined by one loopback
    transport (rooms over the worker's real HTTP server, items over its real ZMQ intake).
    ``worker`` / ``receiver``: overrides of their configs."""
    from encode_worker.config import WorkerConfig
    from encode_worker.worker import EncodeWorker
    from epdserve.data_plane.loopback import LoopbackTransport
    from prefill_side import PrefillReceiver, ReceiverConfig

    loopback = LoopbackTransport()
    worker_config = WorkerConfig(
        **{
            **dict(
                model=tower.model_id,
                transports=("loopback",),
                bootstrap_port=0,
                intake_port=0,
                bind="127.0.0.1",
                ring_bytes=8 << 20,
                ring_slot_bytes=1 << 16,
                receiver_wait_s=10,
            ),
            **(worker or {}),
        }
    )
    encode_worker = EncodeWorker(
        worker_config, tower=tower, transports={"loopback": loopback}
    ).start()
    receiver_config = ReceiverConfig(
        **{
            **dict(
                width=tower.info.wire_width,
                dtype="float32",
                pool_bytes=8 << 20,
                slot_bytes=1 << 16,
                item_timeout_s=10,
            ),
            **(receiver or {}),
        }
    )
    prefill = PrefillReceiver(
        receiver_config, transports={"loopback": loopback}, local_tower=local_tower
    )
    try:
        yield encode_worker, prefill, loopback
    finally:
        prefill.close()
        encode_worker.stop()


def other_weights(model: str, directory) -> str:
    """A copy of the checkpoint ``model`` in ``directory`` (give it ``model``'s folder name: the
    same served name) whose vision weights are others: the same architecture, another model."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, directory)
    generator = torch.Generator().manual_seed(5)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.startswith(("visual.", "model.visual.")) and tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensors[name] = tensor + (0.05 * noise).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return str(directory)
