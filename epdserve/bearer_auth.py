"""The bearer token an HTTP API's ``/v1`` routes require, as vLLM's ``--api-key`` does: ASGI
middleware that answers 401 (OpenAI's error shape) to a ``/v1`` request without
``Authorization: Bearer <token>``, comparing in constant time; probes (``/health``, ``/readyz``)
and ``/metrics`` stay open, as vLLM's do. ``epd-prefill`` takes the handshake token so; the
gateway its client API key."""

from __future__ import annotations

import hmac
import json


def bearer_matches(headers: dict[bytes, bytes], token: bytes) -> bool:
    """Whether ``headers`` (an ASGI scope's, as a dict) carry ``Authorization: Bearer <token>``."""
    given = headers.get(b"authorization", b"")
    scheme, _, value = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), token)


class BearerAuth:
    """Requires ``token`` on every ``/v1`` HTTP request (None: nothing is required)."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if (
            self.token is None
            or scope["type"] != "http"
            or not scope["path"].startswith("/v1")
            or bearer_matches(dict(scope["headers"]), self.token)
        ):
            return await self.app(scope, receive, send)
        body = json.dumps(
            {
                "error": {
                    "message": "missing or wrong API key (Authorization: Bearer <key>)",
                    "type": "authentication_error",
                    "param": None,
                    "code": 401,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
