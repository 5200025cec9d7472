"""A response body read up to a limit: what the gateway reads of a server whose answer it does
not control (an image or video URL's host, vLLM's ``/metrics``)."""

from __future__ import annotations

import aiohttp

CHUNK_BYTES = 1 << 16


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """``response``'s body, or None where it declares or turns out to be over ``limit`` bytes
    (read no further than that)."""
    if (response.content_length or 0) > limit:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
