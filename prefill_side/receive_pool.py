"""The receive pool and the transports that write into it: one registered region per process (a
``/dev/shm`` segment, so same-node writers can map it), sliced into slots, and what is offered to
writers while it lasts.

If someone unlinks the pool's ``/dev/shm`` segment, same-node writers can no longer map it: the
pool notices at the next job (or health check), stops offering the transports that need it
(``TransportSpec.needs_shm_pool``: SHM), says so once in the log and in ``health()``, and goes on
over its other transports; with none left, ``health()`` says the process cannot receive (restart
it: a new process makes a new pool)."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

from epdserve.data_plane.pool import MemoryRegion, SlotPool
from epdserve.data_plane.shm import ShmError
from epdserve.data_plane.transport import TransportUnavailable, build_transports
from epdserve.wire.offers import transport_spec
from prefill_side.settings import ReceiverConfig

log = logging.getLogger(__name__)


class ReceivePool:
    """Ownership: the pool and the transports are this object's; ``lost`` (the transports no
    longer offered, with why) is replaced whole under ``_lost_lock`` by whichever thread notices
    the segment gone."""

    def __init__(
        self,
        config: ReceiverConfig,
        transports: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = SlotPool(
            _region(config, transports), config.slot_bytes, config.quarantine_s, clock
        )
        try:
            self.transports = (
                transports
                if transports is not None
                else build_transports(config.transports, optional=True)
            )
            if self.pool.region.shm is None:  # /dev/shm had no room: nothing for same-node writers
                self.transports = {
                    name: t
                    for name, t in self.transports.items()
                    if not transport_spec(name).needs_shm_pool
                }
                if not self.transports:
                    raise TransportUnavailable(
                        "no transport left: /dev/shm has no room for the pool and "
                        "no transport without it is available"
                    )
            for transport in self.transports.values():
                transport.register(self.pool.region)
        except BaseException:
            self.pool.region.close()
            raise
        self.lost: dict[str, str] = {}
        # offered only while the pool's /dev/shm segment is linked
        self._shm_bound = tuple(
            name for name in self.transports if transport_spec(name).needs_shm_pool
        )
        self._lost_lock = threading.Lock()

    def live(self) -> list[str]:
        """The transports not lost (as last checked)."""
        return [name for name in self.transports if name not in self.lost]

    def offered(self) -> list[str]:
        """The transports offered to writers now (SHM leaves once its segment is gone)."""
        self.check_shm()
        return self.live()

    def offers(self, lease) -> list:
        """What a registration offers for ``lease``: one offer per transport still offered."""
        return [self.transports[name].offer(self.pool, lease) for name in self.live()]

    def health(self) -> dict:
        """The transports offered and lost, the pool's slots, and ``cannot_receive`` /
        ``not_ready``: why the process cannot receive at all (no transport left: only a restart
        helps), or cannot take an item now (no free slot), else None."""
        offered = self.offered()
        stats = self.pool.stats()
        cannot_receive = (
            None if offered else f"no transport left to offer: {'; '.join(self.lost.values())}"
        )
        not_ready = cannot_receive or (
            f"receive pool exhausted: 0 of {stats['slots']} slots free ({stats['leased_slots']} "
            "leased, "
            f"{stats['quarantined_slots']} quarantined)"
            if stats["free_slots"] == 0
            else None
        )
        return {
            "transports": offered,
            "lost": dict(self.lost),
            "pool": stats,
            "cannot_receive": cannot_receive,
            "not_ready": not_ready,
        }

    def check_shm(self) -> None:
        """Stop offering the transports that need the pool's ``/dev/shm`` segment once ``/dev/shm``
        no longer names it (said once)."""
        if not self._shm_bound or self._shm_bound[0] in self.lost or self.pool.region.shm_linked():
            return
        with self._lost_lock:
            if self._shm_bound[0] in self.lost:
                return
            reason = (
                f"the receive pool's SHM segment {self.pool.region.shm.name} is gone from /dev/shm "
                "(unlinked by someone else): same-node writers cannot map it"
            )
            self.lost = {**self.lost, **dict.fromkeys(self._shm_bound, reason)}
        others = self.live()
        log.warning(
            "%s; %s no longer offered, %s",
            reason,
            ", ".join(self._shm_bound),
            f"receiving over {', '.join(others)}"
            if others
            else "and no transport is left: restart this process",
        )

    def close(self) -> None:
        """Unregister the pool from every transport, close them, unlink the segment."""
        try:
            for transport in self.transports.values():
                transport.unregister(self.pool.region)
                transport.close()
        finally:
            self.pool.region.close()


def _region(config: ReceiverConfig, transports: dict | None) -> MemoryRegion:
    """The receive pool's memory: a /dev/shm segment, so same-node writers can map it. When /dev/shm
    has no room for it (ENOSPC) and a transport that does not need the segment is offered too
    (Mooncake), process memory instead, said in a warning. With only transports that need it (SHM),
    the ENOSPC stands."""
    try:
        return MemoryRegion.shared(config.pool_bytes)
    except ShmError as exc:
        names = list(transports) if transports is not None else list(config.transports)
        others = [name for name in names if not transport_spec(name).needs_shm_pool]
        if exc.errno != errno.ENOSPC or not others:
            raise
        log.warning(
            "no room in /dev/shm for the %d-byte receive pool (%s): using process memory, "
            "%s only (no SHM)",
            config.pool_bytes,
            exc.strerror,
            ", ".join(others),
        )
        return MemoryRegion.anonymous(config.pool_bytes)
