"""An OpenAI ``image_url`` (or vLLM's ``video_url``) to the item's bytes: ``data:`` URIs decoded,
``http(s)`` URLs fetched.

Contract: every image is at most ``max_bytes``, every video at most ``max_video_bytes``; a fetch
gets ``timeout_s`` in all (redirects included), follows at most ``max_redirects`` redirects, and
takes only an answer of the item's kind (``image/*``, ``video/*``).
Unless ``allow_private`` is set, no hop may reach a loopback, private, link-local, multicast,
reserved or unspecified address: a literal IP is checked before the hop, a name is checked on
every address the resolver returns for the connection itself (so a name that resolves elsewhere
the second time cannot slip through). Any refusal is a ``MediaError`` whose text is for the client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from epdserve.gateway.bounded_body import read_at_most

REDIRECTS = frozenset({301, 302, 303, 307, 308})
ARTICLE = {"image": "an", "video": "a"}  # "an image/* type", "a video/* type"


class MediaError(ValueError):
    """This item cannot be used; the message says why, in terms the client understands."""


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class PublicOnlyResolver(AbstractResolver):
    """The default resolver, keeping only global unicast addresses (none left: refused)."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = [r for r in await self._inner.resolve(host, port, family) if _public(r["host"])]
        if not results:
            raise OSError(f"{host} resolves only to private or reserved addresses")
        return results

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    def __init__(
        self,
        max_bytes: int = 20 << 20,
        timeout_s: float = 10.0,
        max_redirects: int = 3,
        allow_private: bool = False,
        max_video_bytes: int = 64 << 20,
    ):
        self.timeout_s = timeout_s
        self.limits = {"image": max_bytes, "video": max_video_bytes}
        self.max_redirects, self.allow_private = max_redirects, allow_private
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def load(self, url: str, kind: str = "image") -> bytes:
        """The image (or video: ``kind``) ``url`` names (``data:`` or ``http(s)://``)."""
        if url.startswith("data:"):
            return self.decode_data_uri(url, kind)
        if url.startswith(("http://", "https://")):
            try:
                return await asyncio.wait_for(self._fetch(url, kind), self.timeout_s)
            except TimeoutError:
                raise MediaError(
                    f"fetching {_short(url)} took longer than {self.timeout_s:g} s"
                ) from None
        raise MediaError(f"{kind}_url must be a data: URI or an http(s) URL, got {_short(url)}")

    def decode_data_uri(self, url: str, kind: str = "image") -> bytes:
        limit = self.limits[kind]
        header, comma, payload = url[5:].partition(",")
        if not comma:
            raise MediaError("data URI without a ',' before its payload")
        media_type, *parameters = header.split(";")
        if not media_type.lower().startswith(f"{kind}/"):
            raise MediaError(
                f"data URI of type {media_type or '(none)'!r}: {ARTICLE[kind]} {kind}/* type is "
                "required"
            )
        if "base64" not in (p.strip().lower() for p in parameters):
            raise MediaError("data URI is not base64 (';base64,' is required)")
        if len(payload) > (limit + 2) // 3 * 4 + 4:
            raise MediaError(f"{kind} larger than {limit} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("data URI payload is not valid base64") from None
        if not data:
            raise MediaError(f"data URI carries an empty {kind}")
        if len(data) > limit:
            raise MediaError(f"{kind} larger than {limit} bytes")
        return data

    async def _fetch(self, url: str, kind: str) -> bytes:
        limit = self.limits[kind]
        session = self._client()
        for _ in range(self.max_redirects + 1):
            target = self._checked(url)
            try:
                async with session.get(target, allow_redirects=False) as response:
                    if response.status in REDIRECTS:
                        location = response.headers.get("Location")
                        if not location:
                            raise MediaError(
                                f"{_short(url)} answered {response.status} without a Location"
                            )
                        url = str(target.join(yarl.URL(location)))
                        continue
                    if response.status != 200:
                        raise MediaError(f"{_short(url)} answered HTTP {response.status}")
                    answered = (
                        response.headers.get("Content-Type", "").split(";")[0].strip().lower()
                    )
                    if not answered.startswith(f"{kind}/"):
                        raise MediaError(
                            f"{_short(url)} is {answered or 'of no content type'}, "
                            f"not {ARTICLE[kind]} {kind}/* type"
                        )
                    data = await read_at_most(response, limit)
                    if data is None:
                        raise MediaError(f"{_short(url)}: {kind} larger than {limit} bytes")
                    if not data:
                        raise MediaError(f"{_short(url)} answered an empty body")
                    return data
            except aiohttp.ClientError as exc:
                raise MediaError(f"cannot fetch {_short(url)}: {_reason(exc)}") from None
        raise MediaError(f"{_short(url)}: more than {self.max_redirects} redirects")

    def _checked(self, url: str) -> yarl.URL:
        """One hop's URL, refused when it is not http(s) or names a non-public IP literal."""
        try:
            target = yarl.URL(url)
        except ValueError:
            raise MediaError(f"{_short(url)} is not a URL") from None
        if target.scheme not in ("http", "https") or not target.host:
            raise MediaError(f"{_short(url)}: only http(s) URLs with a host are fetched")
        if not self.allow_private:
            try:
                literal = ipaddress.ip_address(target.host.strip("[]"))
            except ValueError:
                literal = None  # a name: PublicOnlyResolver checks what it resolves to
            if literal is not None and not _public(str(literal)):
                raise MediaError(f"{_short(url)}: private or reserved addresses are not fetched")
            if target.host.lower() == "localhost" or target.host.lower().endswith(".localhost"):
                raise MediaError(f"{_short(url)}: private or reserved addresses are not fetched")
        return target

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            resolver = None if self.allow_private else PublicOnlyResolver()
            connector = aiohttp.TCPConnector(resolver=resolver, limit=64, ttl_dns_cache=10)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=True, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session


def _reason(exc: aiohttp.ClientError) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, OSError):
        return str(exc.os_error.strerror or exc.os_error)
    return type(exc).__name__


def _short(url: str, limit: int = 80) -> str:
    return repr(url if len(url) <= limit else url[:limit] + "...")
