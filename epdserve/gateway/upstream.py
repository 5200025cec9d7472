"""vLLM as the gateway calls it: chat completions posted (``Upstream``), its server-sent events
read one by one, the first token (or error) among them found."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
from fastapi.responses import Response

from epdserve.gateway.errors import OpenAIError


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
