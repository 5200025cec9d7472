"""vLLM as the gateway calls it: a prepared request forwarded and its answer relayed
(``Forwarder``), chat completions posted (``Upstream``), its server-sent events read one by one,
the first token (or error) among them found.

A request is forwarded once the encode workers hold every placed item's rows (``stage_wait_s``:
vLLM then waits for a write, not an encode; an item whose worker failed it goes inline instead),
and its answer relayed, streamed or not, with the gateway's ``epd`` report. A request whose
delivery fails inside vLLM (vLLM answers 500, or its stream's first event is an error) is sent once
more with every item inline when ``retry_colocated``. A client that leaves, or a vLLM refusal,
cancels the request's rooms at once (the workers drop those items)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from epdserve.dispatcher.staged import StagedWatch
from epdserve.gateway.errors import OpenAIError, UpstreamRefusal
from epdserve.gateway.metrics import GatewayMetrics
from epdserve.gateway.placement import Placements, Reason
from epdserve.gateway.prepared import PreparedChat
from epdserve.gateway.settings import GatewaySettings
from epdserve.wire.ec_params import DeliveryReport

log = logging.getLogger(__name__)


class Upstream:
    """The vLLM OpenAI server the gateway forwards to: one pooled session for the gateway's life
    (opened by ``start``, closed by ``close``), each call bounded by ``--request-timeout-s``."""

    def __init__(self, url: str, request_timeout_s: float, api_key: str | None = None):
        """``api_key``: vLLM's ``--api-key``, sent with every call."""
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, body: dict) -> aiohttp.ClientResponse:
        try:
            return await self._session.post(self.url + "/v1/chat/completions", json=body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OpenAIError(
                502,
                f"vLLM at {self.url} cannot be reached: {type(exc).__name__}: {exc}",
                kind="upstream_error",
            ) from None

    async def models(self) -> Response:
        try:
            async with self._session.get(self.url + "/v1/models") as response:
                return Response(
                    await response.read(),
                    status_code=response.status,
                    media_type="application/json",
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return OpenAIError(
                502,
                f"vLLM at {self.url} cannot be reached: {exc}",
                kind="upstream_error",
            ).response()

    async def ready(self) -> bool:
        try:
            async with self._session.get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


async def chain_events(held: list[bytes], events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for event in held:
        yield event
    async for event in events:
        yield event


async def server_events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Server-sent events, each with its blank line, as vLLM wrote them."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer.strip():
        yield buffer


def first_token_or_error(event: bytes) -> str | None:
    """ "token" for an event with generated text or a finish, "error" for an error event, else
    None."""
    if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
        return None
    try:
        data = json.loads(event[6:])
    except ValueError:
        return None
    if "error" in data:
        return "error"
    for choice in data.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return "token"
    return None


FINISHING = b'"finish_reason":"'  # in a stream's chunk that ends a completion (vLLM's JSON)


def with_report(event: bytes, report: dict) -> bytes:
    """A completion's last chunk with the gateway's ``epd`` report beside its choices (vLLM
    sends no delivery report in a stream: the report says where each image was encoded); any
    other event as it is."""
    if not event.startswith(b"data: "):
        return event
    try:
        chunk = json.loads(event[6:])
    except ValueError:
        return event
    if not isinstance(chunk, dict) or "choices" not in chunk:
        return event
    chunk["epd"] = report
    return f"data: {json.dumps(chunk)}\n\n".encode()


class Forwarder:
    """One prepared request forwarded to vLLM and its answer relayed, streamed or not (see the
    module's docstring); the request's inline patches released once its prefill is over."""

    def __init__(
        self,
        upstream: Upstream,
        settings: GatewaySettings,
        staged: StagedWatch | None,
        placements: Placements,
        metrics: GatewayMetrics,
        cancel: Callable[[PreparedChat, str], None],
    ):
        """``staged``: None when the gateway does not wait for the workers' rows;
        ``cancel(prepared, reason)``: cancels the request's rooms."""
        self.upstream = upstream
        self.settings = settings
        self.staged = staged
        self.placements = placements
        self.metrics = metrics
        self.cancel = cancel

    async def _until_client_leaves(
        self, request: Request, coroutine, prepared: PreparedChat
    ) -> asyncio.Task | None:
        """The finished task of ``coroutine``, or None when the client left first: then the
        coroutine is cancelled (dropping the vLLM call makes vLLM abort the request) and so are
        the request's rooms."""
        work = asyncio.ensure_future(coroutine)
        left = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if work.done():
            return work
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        self.cancel(prepared, "the client disconnected")
        self.metrics.count("client_disconnected")
        return None

    def _failed(self, prepared: PreparedChat, exc: OpenAIError | UpstreamRefusal) -> Response:
        self.cancel(prepared, str(exc))
        self.metrics.count("upstream_error")
        if isinstance(exc, UpstreamRefusal):
            return Response(exc.payload, status_code=exc.status, media_type="application/json")
        return exc.response()

    async def _until_staged(self, prepared: PreparedChat) -> None:
        """Until the encode workers hold the rows of every placed item (or ``stage_wait_s``
        passed): vLLM then waits for a write, not an encode. An item whose room ended instead
        (the worker failed it) goes to vLLM inline."""
        if self.staged is None or not prepared.placed:
            return
        started = time.monotonic()
        ended = await self.staged.until_staged(prepared.placed, self.settings.stage_wait_s)
        prepared.staged_s = time.monotonic() - started
        self.metrics.staged.labels(self.metrics.model_name).observe(prepared.staged_s)
        for item in prepared.placed:
            reason = ended.get(item.index)
            if reason is not None:
                item.worker, item.error = (
                    None,
                    f"the encode worker ({item.worker}) failed it, {reason}; vLLM encoded it",
                )
                self.placements.send_inline(prepared, item, Reason.ENCODE_FAILED, moved=True)

    def _fall_back_inline(self, prepared: PreparedChat) -> None:
        """The request failed in vLLM with encode-worker images: from now on vLLM encodes them."""
        log.warning(
            "request %s failed in vLLM with encode-worker images; retrying with them inline",
            prepared.request_id,
        )
        for item in prepared.placed:
            item.worker, item.error = (
                None,
                f"delivery failed in vLLM (worker {item.worker}); vLLM encoded it",
            )
            self.placements.send_inline(prepared, item, Reason.DELIVERY_FAILED, moved=True)

    # ---- non-streaming ------------------------------------------------------------------------

    async def complete(self, request: Request, prepared: PreparedChat, started: float) -> Response:
        """vLLM's whole answer, with the ``epd`` report (``started``: when the request came)."""
        try:
            call = await self._until_client_leaves(request, self._call(prepared), prepared)
        finally:
            self.placements.release_inline(prepared)
        if call is None:
            return Response(status_code=499)
        try:
            payload = call.result()
        except (OpenAIError, UpstreamRefusal) as exc:
            return self._failed(prepared, exc)
        self.placements.first_token(prepared, started)
        self.metrics.count("ok")
        return Response(payload, media_type="application/json")

    async def _call(self, prepared: PreparedChat) -> bytes:
        """vLLM's answer (``UpstreamRefusal`` for another status than 200); on a failed EPD
        delivery, once more with the images inline. The answer gets the ``epd`` report (where each
        image was encoded, and how it arrived)."""
        await self._until_staged(prepared)
        async with await self.upstream.post(prepared.vllm_body()) as response:
            status, payload = response.status, await response.read()
        if status == 500 and prepared.placed and self.settings.retry_colocated:
            self._fall_back_inline(prepared)
            async with await self.upstream.post(prepared.vllm_body()) as response:
                status, payload = response.status, await response.read()
        if status != 200:
            raise UpstreamRefusal(status, payload)
        try:
            answer = json.loads(payload)
            delivery = answer.pop("ec_transfer_params", None)
            report = prepared.report(DeliveryReport.model_validate(delivery) if delivery else None)
            answer["epd"] = report.model_dump(mode="json")
        except (ValueError, AttributeError) as exc:  # not the answer we know: relay vLLM's as it is
            log.warning(
                "request %s: vLLM's answer carries no delivery report we read: %s",
                prepared.request_id,
                exc,
            )
            return payload
        return json.dumps(answer).encode()

    # ---- streaming ----------------------------------------------------------------------------

    async def stream(self, request: Request, prepared: PreparedChat, started: float) -> Response:
        """vLLM's answer as it streams, its last chunk with the ``epd`` report."""
        try:
            opened = await self._until_client_leaves(request, self._open(prepared), prepared)
        except BaseException:
            self.placements.release_inline(prepared)
            raise
        if opened is None:
            self.placements.release_inline(prepared)
            return Response(status_code=499)
        try:
            response, held, events = opened.result()
        except (OpenAIError, UpstreamRefusal) as exc:
            self.placements.release_inline(prepared)
            return self._failed(prepared, exc)
        return StreamingResponse(
            self._relay(response, held, events, prepared, started), media_type="text/event-stream"
        )

    async def _open(
        self, prepared: PreparedChat
    ) -> tuple[aiohttp.ClientResponse, list[bytes], AsyncIterator[bytes]]:
        """vLLM's stream, its events up to the first token held back when a failed delivery must
        be retried inline (it shows up there as an error event); ``UpstreamRefusal`` for another
        status than 200. The stream is closed if this is cancelled (the client left)."""
        await self._until_staged(prepared)
        response = await self.upstream.post(prepared.vllm_body())
        try:
            if response.status != 200:
                raise UpstreamRefusal(response.status, await response.read())
            events, held = server_events(response), []
            if not (prepared.placed and self.settings.retry_colocated):
                return response, held, events
            async for event in events:
                held.append(event)
                if first_token_or_error(event) is not None:
                    break
            if not held or first_token_or_error(held[-1]) != "error":
                return response, held, events
            response.close()
            self._fall_back_inline(prepared)
            response = await self.upstream.post(prepared.vllm_body())
            if response.status != 200:
                raise UpstreamRefusal(response.status, await response.read())
            return response, [], server_events(response)
        except BaseException:
            response.close()
            raise

    async def _relay(
        self,
        response: aiohttp.ClientResponse,
        held: list[bytes],
        events: AsyncIterator[bytes],
        prepared: PreparedChat,
        started: float,
    ) -> AsyncIterator[bytes]:
        outcome, waiting_first = "client_disconnected", True
        report = None
        try:
            async for event in chain_events(held, events):
                if FINISHING in event:  # a completion's last chunk carries the report
                    report = report or prepared.report(None).model_dump(mode="json")
                    event = with_report(event, report)
                if waiting_first and first_token_or_error(event) == "token":
                    waiting_first = False
                    self.placements.release_inline(prepared)
                    self.placements.first_token(prepared, started)
                yield event
            outcome = "ok"
        except (
            aiohttp.ClientError
        ) as exc:  # vLLM's side of the stream broke: the client's ends here too
            log.warning("request %s: vLLM's stream broke: %s", prepared.request_id, exc)
            outcome = "upstream_error"
            error = {
                "message": f"vLLM's stream broke: {type(exc).__name__}",
                "type": "upstream_error",
                "param": None,
                "code": 502,
            }
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
        finally:
            self.placements.release_inline(prepared)
            response.close()  # before the end: vLLM sees the connection drop and aborts the request
            if outcome != "ok":
                self.cancel(prepared, outcome.replace("_", " "))
            self.metrics.count(outcome)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
