"""An encode worker that is always busy: real rooms, an intake that refuses every item."""

import threading

import zmq

from epdserve.dispatcher.workers import WorkerAddress
from epdserve.wire.intake import (
    BATCH_MARKER,
    QUEUE_FULL_RETRY_S,
    IntakeBatch,
    IntakeBatchReply,
    IntakeReply,
    IntakeRequest,
    IntakeStatus,
)
from handshake.app import create_app
from handshake.rooms import RoomTable
from handshake.server import ThreadedServer


class BusyWorker:
    """A worker whose rooms are real (a handshake server) and whose intake refuses every item
    busy (``reason``) with ``retry_after_s``, counting the messages it is sent."""

    def __init__(
        self,
        reason: str = "queue full",
        retry_after_s: float = QUEUE_FULL_RETRY_S,
        fingerprint=None,
    ):
        """``fingerprint``: the model it says it serves in /readyz (None: it says none)."""
        self.table = RoomTable()
        self.server = ThreadedServer(create_app(self.table, fingerprint=fingerprint)).start()
        self.items = 0  # items refused (a dispatcher sends an item in a batch message)
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.intake_port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()

        def serve():
            while not self._stop.is_set():
                if not self._socket.poll(50):
                    continue
                identity, first, *rest = self._socket.recv_multipart()
                batch = first == BATCH_MARKER  # else one item in the one-item form
                items = (
                    IntakeBatch.model_validate_json(rest[0]).items
                    if batch
                    else [IntakeRequest.model_validate_json(first)]
                )
                self.items += len(items)
                replies = [
                    IntakeReply(
                        status=IntakeStatus.REFUSED,
                        room=item.encode_handshake.bootstrap_room,
                        reason=reason,
                        retry_after_s=retry_after_s,
                    )
                    for item in items
                ]
                answer = (
                    IntakeBatchReply(replies=replies).frames() if batch else [replies[0].frame()]
                )
                self._socket.send_multipart([identity, *answer])
            self._socket.close(0)

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        self.address = WorkerAddress("127.0.0.1", self.server.port, self.intake_port)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.stop()
