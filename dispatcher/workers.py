"""Which encode workers a dispatcher may use: a static list or a DNS name (a Kubernetes headless
Service), each kept in the hash ring only while its ``/readyz`` answers 200.

A worker that fails a check, or a dispatch, leaves the ring at once; it rejoins after
``rise`` good checks in a row. DNS is re-resolved on every round, so replicas that come and go
join and leave without a restart.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass

import aiohttp

from dispatcher.ring import HashRing
from multimodal.wire import endpoint_url

log = logging.getLogger(__name__)
MAX_WORKERS = 1024
HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})")  # a DNS name or an IPv4 address
DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_INTAKE_PORT = 8999


@dataclass(frozen=True)
class WorkerAddress:
    host: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    intake_port: int = DEFAULT_INTAKE_PORT

    @property
    def name(self) -> str:
        return f"{self.host}:{self.bootstrap_port}"

    @property
    def url(self) -> str:
        return endpoint_url("http", self.host, self.bootstrap_port)

    @property
    def intake_endpoint(self) -> str:
        return endpoint_url("tcp", self.host, self.intake_port)

    @classmethod
    def parse(cls, text: str) -> WorkerAddress:
        """``host``, ``host:bootstrap_port`` or ``host:bootstrap_port:intake_port``; an IPv6 host
        in brackets (``[fd00::5]:8998:8999``)."""
        text = text.strip()
        if text.startswith("["):
            v6, bracket, rest = text[1:].partition("]")
            try:
                ipaddress.IPv6Address(v6)
            except ValueError:
                raise ValueError(f"worker {text!r}: {v6!r} is not an IPv6 address") from None
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"worker {text!r}: expected [ipv6][:bootstrap_port[:intake_port]]")
            parts = [v6, *rest[1:].split(":")] if rest else [v6]
        else:
            parts = text.split(":")
            if parts[0] and not HOST.fullmatch(parts[0]):
                raise ValueError(f"worker {text!r}: {parts[0]!r} is not a host name or IPv4 address "
                                 "(an IPv6 address goes in brackets)")
        if not parts[0] or len(parts) > 3:
            raise ValueError(f"worker {text!r}: expected host[:bootstrap_port[:intake_port]]")
        try:
            ports = [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"worker {text!r}: ports must be numbers") from None
        if any(not 0 < p < 65536 for p in ports):
            raise ValueError(f"worker {text!r}: ports must be in 1..65535")
        return cls(parts[0], *ports)


@dataclass
class _Health:
    address: WorkerAddress
    healthy: bool = False
    good_checks: int = 0
    reason: str = "not checked yet"


class WorkerSet:
    """The workers and the ring of the healthy ones. ``refresh()`` runs one round of discovery and
    checks; ``run()`` repeats it every ``interval_s`` until cancelled."""

    def __init__(self, static: list[WorkerAddress] = (), dns_name: str | None = None,
                 bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT, intake_port: int = DEFAULT_INTAKE_PORT,
                 interval_s: float = 2.0, check_timeout_s: float = 1.0, rise: int = 1, replicas: int = 64):
        if not static and not dns_name:
            raise ValueError("give encode workers: a static list or a DNS name")
        self.static = list(static)
        self.dns_name = dns_name
        self.bootstrap_port = bootstrap_port
        self.intake_port = intake_port
        self.interval_s = interval_s
        self.check_timeout = aiohttp.ClientTimeout(total=check_timeout_s)
        self.rise = rise
        self.ring = HashRing(replicas=replicas)
        self._workers: dict[str, _Health] = {}
        self._session: aiohttp.ClientSession | None = None

    def address(self, name: str) -> WorkerAddress:
        return self._workers[name].address

    def status(self) -> dict[str, str]:
        """Each known worker: "healthy" or why it is out of the ring."""
        return {name: "healthy" if h.healthy else h.reason for name, h in self._workers.items()}

    def candidates(self, content_hash: int, near: str | None = None) -> list[WorkerAddress]:
        """Healthy workers for an item in ring order from its hash. With ``near`` (the host of the
        request's prefill engine), that host's workers come first: same-node SHM beats cache
        affinity, and the hash still spreads items over the workers there."""
        ordered = [self._workers[name].address for name in self.ring.walk(content_hash)]
        if near is None:
            return ordered
        return [a for a in ordered if a.host == near] + [a for a in ordered if a.host != near]

    def mark_down(self, address: WorkerAddress, reason: str) -> None:
        """A dispatch to this worker failed: out of the ring until its checks pass again."""
        health = self._workers.get(address.name)
        if health is not None and health.healthy:
            log.warning("encode worker %s leaves the ring: %s", address.name, reason)
            health.healthy, health.good_checks, health.reason = False, 0, reason
            self.ring.remove(address.name)

    async def refresh(self) -> None:
        addresses = await self._discover()
        for name in list(self._workers):
            if name not in {a.name for a in addresses}:
                del self._workers[name]
                self.ring.remove(name)
        for address in addresses:
            self._workers.setdefault(address.name, _Health(address))
        await asyncio.gather(*(self._check(health) for health in self._workers.values()))

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a bad round (DNS hiccup) must not stop the checks
                log.exception("encode worker discovery failed")
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _discover(self) -> list[WorkerAddress]:
        if not self.dns_name:
            return self.static
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.dns_name, self.bootstrap_port,
                                                                 type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            log.warning("cannot resolve %s: %s", self.dns_name, exc)
            return [h.address for h in self._workers.values()]  # keep what we had; checks still run
        hosts = sorted({info[4][0] for info in infos})[:MAX_WORKERS]
        return [WorkerAddress(host, self.bootstrap_port, self.intake_port) for host in hosts]

    async def _check(self, health: _Health) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.check_timeout)
        try:
            async with self._session.get(health.address.url + "/readyz") as response:
                ok, reason = response.status == 200, f"/readyz answered {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, reason = False, f"/readyz unreachable: {type(exc).__name__}"
        if not ok:
            if health.healthy:
                log.warning("encode worker %s leaves the ring: %s", health.address.name, reason)
            health.healthy, health.good_checks, health.reason = False, 0, reason
            self.ring.remove(health.address.name)
            return
        health.good_checks += 1
        if not health.healthy and health.good_checks >= self.rise:
            log.info("encode worker %s joins the ring", health.address.name)
            health.healthy, health.reason = True, "healthy"
            self.ring.add(health.address.name)
