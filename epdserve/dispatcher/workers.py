"""Which encode workers a dispatcher may use: a static list or a DNS name (a Kubernetes headless
Service), each kept in the hash ring only while its ``/readyz`` answers 200 and says it serves the
engine's model (its fingerprint, ``epdserve.wire.fingerprint``: a worker of another model is
``incompatible``, out of the ring, with the parts that differ).

A worker that fails a check, or a dispatch, leaves the ring at once; it rejoins after
``rise`` good checks in a row. DNS is re-resolved on every round, so replicas that come and go
join and leave without a restart. While a worker is out of the ring it is checked every
``retry_s`` (a worker that comes up joins within that), the others every ``interval_s``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from epdserve.dispatcher.ring import HashRing
from epdserve.wire.addresses import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_INTAKE_PORT,
    Endpoint,
    canonical_host,
    split_authority,
)
from epdserve.wire.fingerprint import ModelFingerprint

log = logging.getLogger(__name__)
MAX_WORKERS = 1024


@dataclass(frozen=True)
class WorkerAddress:
    """An encode worker: its host, its rooms (bootstrap) port and its intake port."""

    host: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    intake_port: int = DEFAULT_INTAKE_PORT

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "host", self.rooms.host
        )  # bare and canonical, as Endpoint keeps it

    # Computed once (each item's routing reads them): an Endpoint parses its host.
    @functools.cached_property
    def rooms(self) -> Endpoint:
        """The handshake endpoint its rooms live at."""
        return Endpoint(self.host, self.bootstrap_port)

    @functools.cached_property
    def intake(self) -> Endpoint:
        return Endpoint(self.host, self.intake_port)

    @functools.cached_property
    def name(self) -> str:
        """The worker in the ring, in reports and in logs: its rooms' ``host:port``."""
        return self.rooms.authority

    @functools.cached_property
    def url(self) -> str:
        return self.rooms.url("http")

    @functools.cached_property
    def intake_endpoint(self) -> str:
        return self.intake.url("tcp")

    def __str__(self) -> str:
        """``host:bootstrap_port:intake_port`` (an IPv6 host bracketed): what ``parse`` reads
        back."""
        return f"{self.rooms.authority}:{self.intake_port}"

    @classmethod
    def parse(cls, text: str) -> WorkerAddress:
        """``host``, ``host:bootstrap_port`` or ``host:bootstrap_port:intake_port``; an IPv6 host
        in brackets (``[fd00::5]:8990:8999``)."""
        try:
            host, ports = split_authority(text, 2)
        except ValueError as exc:
            raise ValueError(f"worker {text!r}: {exc}") from None
        return cls(host, *ports)


READY = "ready"
INCOMPATIBLE = "incompatible"
UNREADY = "unready"
STATES = (READY, UNREADY, INCOMPATIBLE)


@dataclass
class _Health:
    address: WorkerAddress
    healthy: bool = False
    good_checks: int = 0
    reason: str = "not checked yet"
    fingerprint: ModelFingerprint | None = None  # the model its last /readyz said it serves
    incompatible: bool = False  # it serves another model than the engine's

    @property
    def state(self) -> str:
        return READY if self.healthy else INCOMPATIBLE if self.incompatible else UNREADY


class WorkerSet:
    """The workers and the ring of the healthy ones. ``refresh()`` runs one round of discovery and
    checks; ``run()`` repeats it every ``interval_s`` until cancelled."""

    def __init__(
        self,
        static: list[WorkerAddress] = (),
        dns_name: str | None = None,
        bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
        intake_port: int = DEFAULT_INTAKE_PORT,
        interval_s: float = 2.0,
        check_timeout_s: float = 1.0,
        rise: int = 1,
        replicas: int = 64,
        retry_s: float = 0.5,
    ):
        if not static and not dns_name:
            raise ValueError("give encode workers: a static list or a DNS name")
        self.retry_s = retry_s
        # the engine's model: a worker that says another is incompatible; None: any is taken
        self.engine: ModelFingerprint | None = None
        self.rounds = 0  # rounds of checks done since the engine's model was last set
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
        """Each known worker: "ready", or why it is out of the ring (an incompatible one: which
        parts of its model differ from the engine's)."""
        return {name: READY if h.healthy else h.reason for name, h in self._workers.items()}

    def states(self) -> dict[str, int]:
        """How many workers are in each state (``STATES``)."""
        counts = dict.fromkeys(STATES, 0)
        for health in self._workers.values():
            counts[health.state] += 1
        return counts

    def all_up(self) -> bool:
        """Whether every known worker is in the ring."""
        return all(health.healthy for health in self._workers.values())

    def settled(self) -> bool:
        """Whether every known worker is known to serve: in the ring, or of another model."""
        return all(h.healthy or h.incompatible for h in self._workers.values())

    def why_none(self) -> str:
        """Why no worker took an item: every worker out of the ring, with its reason."""
        out = [f"{name}: {h.reason}" for name, h in self._workers.items() if not h.healthy]
        return "no healthy encode worker" + (f" ({'; '.join(out)})" if out else "")

    def set_engine(self, engine: ModelFingerprint) -> None:
        """The engine's model: workers of another leave the ring (at their next check, which
        comes within ``retry_s``)."""
        if self.engine != engine:
            self.engine, self.rounds = engine, 0
            for health in self._workers.values():
                self._judge(health)

    def candidates(self, content_hash: int, near: str | None = None) -> list[WorkerAddress]:
        """Healthy workers for an item in ring order from its hash. With ``near`` (the host of the
        request's prefill engine), that host's workers come first: same-node SHM beats cache
        affinity, and the hash still spreads items over the workers there."""
        ordered = [self._workers[name].address for name in self.ring.walk(content_hash)]
        if near is None:
            return ordered
        near = canonical_host(near)
        return [a for a in ordered if a.host == near] + [a for a in ordered if a.host != near]

    def mark_down(self, address: WorkerAddress, reason: str) -> None:
        """A dispatch to this worker failed: out of the ring until its checks pass again."""
        health = self._workers.get(address.name)
        if health is not None and health.healthy:
            self._leave(health, reason)

    def mark_incompatible(self, address: WorkerAddress, reason: str) -> None:
        """The worker refused an item as for another model: out of the ring until its checks
        say it serves the engine's (a worker replaced by one of the right model rejoins)."""
        health = self._workers.get(address.name)
        if health is not None and not health.incompatible:
            health.incompatible = True
            self._leave(health, reason)

    async def refresh(self) -> None:
        addresses = await self._discover()
        for name in list(self._workers):
            if name not in {a.name for a in addresses}:
                del self._workers[name]
                self.ring.remove(name)
        for address in addresses:
            self._workers.setdefault(address.name, _Health(address))
        await asyncio.gather(*(self._check(health) for health in self._workers.values()))
        self.rounds += 1

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a bad round (DNS hiccup) must not stop the checks
                log.exception("encode worker discovery failed")
            await asyncio.sleep(self.interval_s if self.all_up() else self.retry_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _discover(self) -> list[WorkerAddress]:
        if not self.dns_name:
            return self.static
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                self.dns_name, self.bootstrap_port, type=socket.SOCK_STREAM
            )
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
                answer = await response.json(content_type=None)
                model = answer.get("model") if isinstance(answer, dict) else None
                health.fingerprint = ModelFingerprint.model_validate(model) if model else None
                if not ok and isinstance(answer, dict) and answer.get("reason"):
                    reason = f"not ready: {answer['reason']}"[:500]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, reason = False, f"/readyz unreachable: {type(exc).__name__}"
        except (ValueError, ValidationError) as exc:  # not the answer of a worker we know
            ok, reason = False, f"/readyz answered what no encode worker says: {exc}"[:500]
        if not ok:
            health.incompatible = False
            self._leave(health, reason)
            return
        if not self._judge(health):
            return
        health.good_checks += 1
        if not health.healthy and health.good_checks >= self.rise:
            log.info("encode worker %s joins the ring", health.address.name)
            health.healthy, health.reason = True, READY
            self.ring.add(health.address.name)

    def _judge(self, health: _Health) -> bool:
        """Whether the worker serves the engine's model (or no engine is known yet); else it is
        incompatible: out of the ring, with the parts that differ."""
        engine, mine = self.engine, health.fingerprint
        if engine is None or (mine is not None and mine.compact == engine.compact):
            health.incompatible = False
            return True
        differences = (
            "; ".join(mine.differences(engine, "the worker", "the engine"))
            if mine is not None
            else "it does not say which model it serves"
        )
        health.incompatible = True
        self._leave(health, f"{INCOMPATIBLE}: {differences}"[:1000])
        return False

    def _leave(self, health: _Health, reason: str) -> None:
        if health.healthy or health.reason != reason:
            log.warning("encode worker %s is out of the ring: %s", health.address.name, reason)
        health.healthy, health.good_checks, health.reason = False, 0, reason
        self.ring.remove(health.address.name)
