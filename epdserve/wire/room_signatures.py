"""Room addresses only the deployment can name: a dispatcher signs each item's room address
(``EncodeHandshake.signature``), and a process about to call a room endpoint with its bearer
token (a receiver registering its rooms, an encode worker reaching a room at another endpoint)
calls only an endpoint whose address carries a valid signature. A request that names another
host, straight to vLLM's API say, gets nothing sent there: no token, no request.

The key is derived from the handshake token every process of the deployment already holds
(HMAC-SHA256 of a fixed label), so there is no second secret to distribute. A signature covers the
room, the endpoint (host as ``Endpoint`` compares it, port) and an expiry, so it cannot be moved
to another endpoint or room, nor used for longer than a room lives. Without a token there is no
credential to leak; a process then calls only loopback endpoints unless told that any address
will do (``UnsignedRooms``: a lab).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from typing import Literal

from epdserve.wire.addresses import EncodeHandshake

VERSION = "v1"
_LABEL = b"epd room address signature v1"
# where a process without a token calls unsigned room endpoints: loopback only, or any (a lab)
UnsignedRooms = Literal["loopback", "any"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RoomSigner:
    """Signs room addresses and checks them, with the key of one handshake token."""

    def __init__(self, token: str):
        self._key = hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()

    def _mac(self, handshake: EncodeHandshake, expires: int) -> str:
        endpoint = handshake.endpoint
        message = f"{VERSION}|{handshake.bootstrap_room}|{endpoint.host}|{endpoint.port}|{expires}"
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def sign(self, handshake: EncodeHandshake, ttl_s: float) -> EncodeHandshake:
        """``handshake`` with a signature valid for ``ttl_s`` seconds."""
        expires = int(time.time() + ttl_s) + 1
        signature = f"{VERSION}.{expires}.{self._mac(handshake, expires)}"
        return handshake.model_copy(update={"signature": signature})

    def refusal(self, handshake: EncodeHandshake) -> str | None:
        """Why ``handshake``'s endpoint must not be called, or None when its signature is this
        deployment's and current."""
        if handshake.signature is None:
            return f"room endpoint {handshake.endpoint} is not signed by the deployment"
        _, expires, mac = handshake.signature.split(".")
        if not hmac.compare_digest(mac, self._mac(handshake, int(expires))):
            return f"room endpoint {handshake.endpoint}: its signature is not the deployment's"
        if int(expires) < time.time():
            return f"room endpoint {handshake.endpoint}: its signature has expired"
        return None


class RoomEndpoints:
    """Which room endpoints a process may call: with a token, those whose address is signed with
    it; without one, loopback ones (or any, with ``unsigned="any"``)."""

    def __init__(self, token: str | None, unsigned: UnsignedRooms = "loopback"):
        self.signer = RoomSigner(token) if token else None
        self.unsigned = unsigned

    def refusal(self, handshake: EncodeHandshake) -> str | None:
        """Why ``handshake``'s endpoint must not be called (nothing is sent there), or None."""
        if self.signer is not None:
            return self.signer.refusal(handshake)
        if self.unsigned == "any" or is_loopback(handshake.endpoint.host):
            return None
        return (
            f"room endpoint {handshake.endpoint} is not on loopback, and this process has no "
            "handshake token to check its signature with"
        )
