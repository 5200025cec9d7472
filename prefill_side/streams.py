"""Items to their end over one room stream per encode-worker endpoint (``wire.room_stream``): a
job's items go out as registrations (the jobs started in one step of the loop share a frame), and
each room's end comes back pushed, the rooms that ended together in one frame. A room that
succeeded goes to the publisher (in the reader: it never waits), one that failed, or whose commit
the publisher refused, to the give-up (on a task of its own: the local tower may run there, and
the reader goes on reading, pongs included).

The stream is opened with the first item for its endpoint and reused by every later job. Whatever
goes wrong, no item is left pending and no slot leased:
* an endpoint whose stream cannot be opened fails the items (nothing was registered: slots freed);
* a stream that closes (or whose writer failed), or a peer that answers no ping within
  ``endpoint_timeout_s`` (a SIGSTOPped or hung process: pings go out once nothing came for half a
  ``poll_s``), fails every item still waiting on it, their slots quarantined (a registration may
  have landed, a writer may still come);
* an item past its deadline has its room cancelled and fails (quarantined), checked every half
  ``poll_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from epdserve.wire.addresses import Endpoint
from epdserve.wire.room_client import HandshakeError
from epdserve.wire.room_stream import OpenOnce, RoomStreamClient
from epdserve.wire.rooms import LOST_AFTER_REGISTRATION, Registration, RoomResult, RoomState
from prefill_side.endpoints import Endpoints
from prefill_side.give_up import GiveUp
from prefill_side.job import PendingItem, ReceiveJob
from prefill_side.publish import Publisher, Refusal
from prefill_side.receive_pool import ReceivePool
from prefill_side.settings import ReceiverConfig

log = logging.getLogger(__name__)


class _Batch:
    """One job's items at one endpoint: ``done`` once the last one has ended (or with the error
    that ended one, as the job's task would have raised it)."""

    __slots__ = ("job", "left", "done")

    def __init__(self, job: ReceiveJob, count: int):
        self.job = job
        self.left = count
        self.done = asyncio.get_running_loop().create_future()

    def one_ended(self, error: BaseException | None = None) -> None:
        self.left -= 1
        if self.done.done():
            return
        if error is not None:
            self.done.set_exception(error)
        elif not self.left:
            self.done.set_result(None)


class _Stream:
    """One endpoint's stream and the items waiting on it, by room."""

    def __init__(self, endpoint: Endpoint, client: RoomStreamClient):
        self.endpoint = endpoint
        self.client = client
        self.live: dict[int, tuple[_Batch, PendingItem]] = {}
        self.watching: asyncio.Task | None = None  # deadlines and pings, while items are live
        self.ping_sent: float | None = None


class EndpointStreams:
    def __init__(
        self,
        config: ReceiverConfig,
        endpoints: Endpoints,
        receive_pool: ReceivePool,
        publish: Publisher,
        give_up: GiveUp,
    ):
        self.config = config
        self.endpoints = endpoints
        self.receive_pool = receive_pool
        self.publish = publish
        self.give_up = give_up
        self._streams: dict[Endpoint, _Stream] = {}
        self._opening = OpenOnce()  # the first job for an endpoint opens it; the others wait
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    async def serve(self, job: ReceiveJob, entries: list[PendingItem]) -> None:
        """One endpoint's items, to their end."""
        endpoint = entries[0].handshake.endpoint
        try:
            stream = await self._stream(endpoint)
            if self._streams.get(endpoint) is not stream or stream.client.closed:
                raise HandshakeError(0, "the room stream closed as it opened")
        except Exception as exc:  # nothing was registered: the slots are free again
            if not isinstance(exc, HandshakeError):
                log.exception("room stream to %s could not be opened", endpoint)
            for entry in entries:
                await self.give_up(
                    job,
                    entry.index,
                    entry.item,
                    f"encode worker endpoint unreachable: {exc}",
                    entry,
                    quarantine=False,
                )
            return
        batch = _Batch(job, len(entries))
        for entry in entries:
            stream.live[entry.handshake.bootstrap_room] = (batch, entry)
        stream.client.register(
            # made from this receiver's own lease and layout: not validated again (the
            # registration's offer checks run in Python, and the room table runs them)
            Registration.model_construct(
                room=entry.handshake.bootstrap_room,
                generation=entry.lease.generation,
                rows=entry.layout.rows,
                width=entry.layout.width,
                dtype=entry.layout.dtype,
                offers=self.receive_pool.offers(entry.lease),
                deadline_s=self.config.item_timeout_s,
                fingerprint=self.config.model_fingerprint,
            )
            for entry in entries
        )
        if stream.watching is None:
            stream.watching = asyncio.create_task(self._watch(stream))
        await batch.done

    async def cancel_rooms(self, endpoint: Endpoint, rooms: list[int], reason: str) -> None:
        """Cancel ``rooms`` at ``endpoint`` (so its worker stops): over its stream where one is
        open, else over REST."""
        stream = self._streams.get(endpoint)
        if stream is None or stream.client.closed:
            await self.endpoints.cancel_rooms(endpoint, rooms, reason)
        else:
            stream.client.cancel(rooms, reason)

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            await stream.client.close()

    # ---- the stream ----------------------------------------------------------------------------

    async def _stream(self, endpoint: Endpoint) -> _Stream:
        stream = self._streams.get(endpoint)
        if stream is not None and not stream.client.closed:
            return stream
        return await self._opening(endpoint, lambda: self._open(endpoint))

    async def _open(self, endpoint: Endpoint) -> _Stream:
        client = await RoomStreamClient.open(self.endpoints.client(endpoint))
        stream = self._streams[endpoint] = _Stream(endpoint, client)
        self._spawn(self._read(stream))
        return stream

    async def _read(self, stream: _Stream) -> None:
        try:
            while True:
                results = await stream.client.receive()
                for result in results:
                    self._ended(stream, result)
        except HandshakeError as exc:
            self._end(stream, f"encode worker endpoint unreachable: {exc}")
        except Exception as exc:
            log.exception("room stream to %s failed", stream.endpoint)
            self._end(stream, f"receiver error: {type(exc).__name__}: {exc}")

    def _end(self, stream: _Stream, reason: str) -> None:
        """The stream is over: every item still waiting on it fails (quarantined), and the next
        job for its endpoint opens a new one."""
        if self._streams.get(stream.endpoint) is stream:
            del self._streams[stream.endpoint]
        live, stream.live = stream.live, {}
        for batch, entry in live.values():
            self._give_up(batch, entry, reason, quarantine=True)
        self._spawn(stream.client.close())

    def _ended(self, stream: _Stream, result: RoomResult) -> None:
        waiting = stream.live.pop(result.room, None)
        if waiting is None:  # not ours (a cancel's answer for a room never registered), or done
            return
        batch, entry = waiting
        job = batch.job
        if not result.ok:
            reason = f"room refused or lost: {result.error}"
            quarantine = result.status == LOST_AFTER_REGISTRATION
        elif result.view.state is RoomState.SUCCESS:
            try:
                refused = self.publish(job, entry, result.view)
            except Exception as exc:  # the item fails, its slot held: the rows may be half-read
                log.exception(
                    "receive job %s: publishing room %d failed", job.request_id, result.room
                )
                refused = Refusal(f"receiver error: {type(exc).__name__}: {exc}", quarantine=True)
            if refused is None:
                batch.one_ended()
                return
            reason, quarantine = refused
        else:
            view = result.view
            reason = f"room {view.state.value}: {view.reason or 'no reason given'}"
            quarantine = not view.writer_settled
        self._give_up(batch, entry, reason, quarantine)

    def _give_up(self, batch: _Batch, entry: PendingItem, reason: str, quarantine: bool) -> None:
        """On a task of its own: a fallback to the local tower holds up no other item."""
        task = self._spawn(
            self.give_up(batch.job, entry.index, entry.item, reason, entry, quarantine=quarantine)
        )
        task.add_done_callback(
            lambda done: batch.one_ended(None if done.cancelled() else done.exception())
        )

    async def _watch(self, stream: _Stream) -> None:
        """While items wait on ``stream``: their deadlines, and a ping when the peer has been
        silent for half a ``poll_s`` (no answer within ``endpoint_timeout_s``: stalled)."""
        tick = self.config.poll_s / 2
        try:
            while stream.live:
                if stream.client.closed:  # its reader ends it too; whichever comes first
                    self._end(stream, "encode worker endpoint unreachable: the room stream closed")
                    return
                await asyncio.sleep(tick)
                now = time.monotonic()
                heard = stream.client.last_heard
                if stream.ping_sent is not None and heard < stream.ping_sent:  # unanswered
                    if now - stream.ping_sent > self.config.endpoint_timeout_s:
                        self._end(
                            stream,
                            "encode worker endpoint unreachable: no answer to a ping within "
                            f"{self.config.endpoint_timeout_s:g} s",
                        )
                        return
                elif now - heard >= tick:
                    stream.ping_sent = now
                    await stream.client.ping()
                late = [room for room, (_, entry) in stream.live.items() if now >= entry.deadline]
                if late:
                    stream.client.cancel(late, "receiver timed out")
                for room in late:
                    batch, entry = stream.live.pop(room)
                    self._give_up(
                        batch, entry, "timed out waiting for the encode worker", quarantine=True
                    )
        except (ConnectionError, HandshakeError) as exc:  # the reader ends the stream
            log.info("room stream to %s: %s", stream.endpoint, exc)
        finally:
            stream.watching = None
            stream.ping_sent = None

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
