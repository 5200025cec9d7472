"""Mooncake TransferEngine transport: one-sided writes into the receiver's registered pool.

One engine per process, created lazily in the process that uses it (an engine inherited across
``fork`` hangs) and kept for life (tearing one down holds the GIL for about a second); or, inside
an engine that already runs a TransferEngine (for its KV cache), that one, adopted
(``MooncakeTransport.adopt``). P2PHANDSHAKE, so no etcd. RDMA is used automatically when an HCA is
present. Mooncake takes ``force_tcp`` and its transfer timeout from ``MC_FORCE_TCP`` and
``MC_TRANSFER_TIMEOUT`` (its log level from ``MC_LOG_LEVEL``, at import): they are set only while
our engine is made and put back after, so an engine made after ours does not find ours in the
environment. (A Mooncake that reads them once per process still applies the first engine's to all.)
Writes are submitted and polled (the sync calls busy-spin a core), each has a deadline, and a
failed write is reported unsettled until Mooncake itself gives up, because it may still land. The
engine behaviours relied on here, and how they were found: docs/performance.md, "Mooncake engine
behaviours".
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from epdserve.data_plane.pool import Lease, MemoryRegion, SlotPool
from epdserve.data_plane.transport import (
    Transfer,
    TransferRefused,
    TransferState,
    Transport,
    TransportUnavailable,
)
from epdserve.wire.offers import MooncakeOffer

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "Mooncake is not usable here: {error}. On CPU hosts: pip install '.[mooncake-cpu]' "
    "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1; on GPU hosts: "
    "pip install '.[mooncake-cuda12]' (or mooncake-cuda13) with the NVIDIA driver present. "
    "Never install two of them."
)
# Mooncake's own timeout is clamped to >= 5 s and grows by 1 ns per byte.
MIN_ENGINE_TIMEOUT_S = 5


class MooncakeUnavailable(TransportUnavailable):
    """The Mooncake package, a library it links, or its engine could not be loaded."""


@dataclass(frozen=True)
class MooncakeConfig:
    hostname: str = "127.0.0.1"  # address peers use to reach this process
    device_names: str = ""  # comma-separated HCA filter; "" = every HCA found
    force_tcp: bool = False
    transfer_timeout_s: int = 10  # Mooncake's own per-transfer give-up time
    log_level: str = "ERROR"

    def engine_timeout_s(self, nbytes: int) -> float:
        """When Mooncake itself gives up on an ``nbytes`` write: after this no byte can land."""
        return max(self.transfer_timeout_s, MIN_ENGINE_TIMEOUT_S) + nbytes * 1e-9


@contextlib.contextmanager
def _quiet_stderr(enabled: bool):
    """glog prints two harmless lines per process whatever MC_LOG_LEVEL says: hide fd 2."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _mooncake_environment(settings: dict[str, str]):
    """``settings`` in the environment for the block only, then each variable as it was."""
    with _ENVIRONMENT_LOCK:
        saved = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _load_engine_class(config: MooncakeConfig):
    # read at import only; an operator's own MC_LOG_LEVEL wins
    level = {} if "MC_LOG_LEVEL" in os.environ else {"MC_LOG_LEVEL": config.log_level}
    try:
        with _quiet_stderr(config.log_level == "ERROR"), _mooncake_environment(level):
            from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeUnavailable(INSTALL_HINT.format(error=exc)) from None
    return TransferEngine


class _MooncakeTransfer(Transfer):
    def __init__(
        self,
        transport: MooncakeTransport,
        src_addr: int,
        nbytes: int,
        offer: MooncakeOffer,
        deadline: float,
    ):
        super().__init__(nbytes, deadline)
        self._transport = transport
        self._args = (offer.session, src_addr, offer.address, nbytes)
        self._retried = False
        self._failed_status: int | None = None  # seen by poll_quick, handled by poll
        self._settle_by = time.monotonic() + transport.config.engine_timeout_s(nbytes) + 1.0
        self._batch_id = self._start()

    def _start(self) -> int | None:
        batch_id = self._transport.engine.transfer_submit_write(*self._args)
        if batch_id < 0:
            self._finish(
                TransferState.FAILED,
                "mooncake refused to submit the write",
                settled=not self._retried,
            )
            return None
        return batch_id

    def poll_quick(self) -> TransferState | None:
        """The engine's status only: a failed status (whose handling may probe the peer or
        resubmit) is kept for ``poll`` and answered None."""
        if self._failed_status is not None:
            return None
        if self._batch_id is not None:
            status = self._transport.engine.transfer_check_status(self._batch_id)
            if status < 0:
                self._failed_status = status
                return None
            return self._advance(status, time.monotonic())
        return self._check_deadlines(time.monotonic())

    def poll(self) -> TransferState:
        status, self._failed_status = self._failed_status, None
        if status is None and self._batch_id is not None:
            status = self._transport.engine.transfer_check_status(self._batch_id)
        return self._advance(status, time.monotonic())

    def _advance(self, status: int | None, now: float) -> TransferState:
        """Act on the engine's status of the write in flight (None: none is)."""
        if status == 1:
            self._batch_id = None  # the engine freed the id: never poll it again
            self._finish(TransferState.DONE)  # also settles a transfer we had given up on
        elif status is not None and status < 0:
            self._batch_id = None
            if self.state is TransferState.PENDING and self._transport.refuses(self._args[0]):
                # no process listens there any more: nothing can land, and the engine has no
                # connection left to read our source for (a retry would wait out its connect)
                self._finish(TransferState.FAILED, "mooncake peer is gone (it refuses connections)")
            elif not self._retried and self.state is TransferState.PENDING and now < self.deadline:
                # a rejected request tears down a TCP lane; one retry rides over it
                self._retried = True
                self._batch_id = self._start()
            else:
                reason = "mooncake transfer " + ("timed out" if status == -2 else "failed")
                self._finish(TransferState.FAILED, reason, settled=False)  # it may still land
        return self._check_deadlines(now)

    def _check_deadlines(self, now: float) -> TransferState:
        if self.state is TransferState.PENDING and now >= self.deadline:
            self._finish(TransferState.FAILED, "deadline exceeded", settled=False)
        if not self.settled and now >= self._settle_by:
            self.settled = True  # past Mooncake's own timeout nothing more can land
        return self.state


class MooncakeTransport(Transport):
    name = "mooncake"
    _instance: MooncakeTransport | None = None
    _instance_lock = threading.Lock()

    def __init__(self, config: MooncakeConfig = MooncakeConfig(), engine=None):
        """A new engine for ``config``, or ``engine``: one the process already runs, initialised
        (P2PHANDSHAKE) at ``config.hostname``, whose own settings stay as they are."""
        self.config = config
        self.pid = os.getpid()
        self.adopted = engine is not None
        if engine is None:
            engine = self._new_engine(config)
        self.engine = engine
        self.session = f"{config.hostname}:{self.engine.get_rpc_port()}"
        self._regions: list[MemoryRegion] = []
        self._reached: set[str] = set()  # sessions a probe has answered
        self._probing: dict[str, threading.Thread] = {}  # at most one hung first contact per peer
        self._lock = threading.Lock()

    @staticmethod
    def _new_engine(config: MooncakeConfig):
        engine_class = _load_engine_class(config)
        timeout_s = max(config.transfer_timeout_s, MIN_ENGINE_TIMEOUT_S)
        settings = {"MC_TRANSFER_TIMEOUT": str(timeout_s)}
        if config.force_tcp:
            settings["MC_FORCE_TCP"] = "1"
        with _quiet_stderr(config.log_level == "ERROR"), _mooncake_environment(settings):
            engine = engine_class()
            rc = engine.initialize(config.hostname, "P2PHANDSHAKE", "tcp", config.device_names)
        if rc != 0:
            raise MooncakeUnavailable(
                f"Mooncake TransferEngine.initialize({config.hostname!r}, P2PHANDSHAKE) "
                f"returned {rc} (is a port free in its range, MC_MIN_RPC_PORT.."
                f"MC_MAX_RPC_PORT or 15000-17000, and is {config.hostname} an address of "
                "this host?)"
            )
        return engine

    @classmethod
    def adopt(cls, engine, config: MooncakeConfig) -> MooncakeTransport:
        """Use the TransferEngine this process already runs (an engine's, for its KV cache),
        initialised with P2PHANDSHAKE at ``config.hostname``, as this process's transport: no second
        engine, no Mooncake setting changed (``config``'s ``force_tcp`` and timeout are the
        engine's own business). ``for_process`` returns it from then on, whatever it is asked."""
        with cls._instance_lock:
            if cls._instance is not None and cls._instance.pid == os.getpid():
                raise ValueError("this process already has its Mooncake transport")
            cls._instance = cls(config, engine=engine)
            return cls._instance

    @classmethod
    def for_process(cls, config: MooncakeConfig = MooncakeConfig()) -> MooncakeTransport:
        """This process's engine, created on first use and kept for the life of the process (or
        the one ``adopt`` was given)."""
        with cls._instance_lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls(config)
            elif cls._instance.adopted:
                return cls._instance
            elif cls._instance.config != config:
                raise ValueError(
                    "the process's Mooncake engine was already created with another config"
                )
            return cls._instance

    @classmethod
    def from_config(cls, config: MooncakeConfig | None = None) -> MooncakeTransport:
        return cls.for_process(config or MooncakeConfig())

    def _check_process(self) -> None:
        if os.getpid() != self.pid:
            raise MooncakeUnavailable(
                "a Mooncake engine cannot be used across fork(); create one per process"
            )

    def register(self, region: MemoryRegion) -> None:
        self._check_process()
        with self._lock:
            if any(r is region for r in self._regions):
                return
            rc = self.engine.register_memory(region.address, region.nbytes)
            if rc != 0:
                raise MooncakeUnavailable(
                    f"register_memory of {region.nbytes} bytes returned {rc}"
                    + (" (overlaps a registered region)" if rc == -7 else "")
                )
            self._regions.append(region)
        log.info(
            "Mooncake registered %d MiB at %s: %s",
            region.nbytes >> 20,
            self.session,
            "TCP (forced)"
            if self.config.force_tcp
            else f"RDMA devices {self.config.device_names}"
            if self.config.device_names
            else "RDMA devices found, or TCP where there are none",
        )

    def offer(self, pool: SlotPool, lease: Lease) -> MooncakeOffer:
        if not any(r is pool.region for r in self._regions):
            raise TransferRefused("pool region is not registered with Mooncake")
        return MooncakeOffer(
            kind="mooncake",
            session=self.session,
            address=pool.region.address + lease.offset,
            capacity=lease.nbytes,
        )

    def reachable(self, offer: MooncakeOffer) -> bool:
        return True  # liveness is `alive(session)`; routability is the fabric's

    def submits_in_background(self, offer: MooncakeOffer) -> bool:
        """A peer already reached: ``transfer_submit_write`` queues the write on the engine's
        threads (a first contact probes the peer first, which may wait up to 2 s)."""
        return offer.session in self._reached

    def alive(self, session: str) -> bool:
        """Liveness probe of a peer engine: a live one answers and a dead one refuses at once (a
        stalled one blocks: see ``_probe``)."""
        self._check_process()
        return self.engine.send_probe(session) == 0

    def _probe(self, session: str, timeout_s: float) -> bool | None:
        """``send_probe`` on a thread of its own (against a stalled peer it blocks, with no timeout,
        until the peer resumes): True if the peer answered, False if it refused, None if no answer
        came within ``timeout_s``. At most one probe per peer, 64 peers, hangs at a time."""
        with self._lock:
            thread = self._probing.get(session)
            if thread is None:
                if len(self._probing) >= 64:
                    return None
                result: dict = {}
                thread = threading.Thread(
                    target=lambda: result.setdefault("ok", self.alive(session)),
                    name=f"mooncake-probe-{session}",
                    daemon=True,
                )
                thread.result = result
                self._probing[session] = thread
                thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            return None
        with self._lock:
            if self._probing.get(session) is thread:
                del self._probing[session]
        return thread.result.get("ok")

    def refuses(self, session: str) -> bool:
        """True when nothing listens at the peer's address any more (it died or closed its engine):
        a probe answered "refused" at once. Such a peer gets a fresh first contact if it returns."""
        if self._probe(session, 0.2) is False:
            self._reached.discard(session)
            return True
        return False

    def _first_contact(self, session: str, timeout_s: float) -> None:
        """Probe a peer before the first write to it. Mooncake's first contact with a stalled (not
        dead) peer blocks inside the engine with no timeout, so the probe runs on a thread of its
        own and the write is refused if it has not answered in time."""
        if session in self._reached:
            return
        answer = self._probe(session, timeout_s)
        if answer is None:
            raise TransferRefused(
                f"Mooncake peer {session} did not answer a first contact in {timeout_s:.1f} s"
            )
        if not answer:
            raise TransferRefused(f"Mooncake peer {session} is not reachable")
        self._reached.add(session)

    def _submit(
        self, src: torch.Tensor, nbytes: int, offer: MooncakeOffer, deadline: float
    ) -> Transfer:
        self._check_process()
        self._first_contact(offer.session, max(0.1, min(2.0, deadline - time.monotonic())))
        address = src.data_ptr()
        # TCP accepts unregistered sources but RDMA needs an lkey: enforce it everywhere.
        if not any(region.contains(address, nbytes) for region in self._regions):
            raise TransferRefused("source bytes are not in a region registered with Mooncake")
        return _MooncakeTransfer(self, address, nbytes, offer, deadline)

    def unregister(self, region: MemoryRegion) -> None:
        with self._lock:
            if any(r is region for r in self._regions):
                self.engine.unregister_memory(region.address)
                self._regions = [r for r in self._regions if r is not region]
