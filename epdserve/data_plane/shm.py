"""POSIX shared memory on ``/dev/shm``: validated names, ``O_NOFOLLOW`` opens, crash-safe unlink.

* ``ShmSegment``: one mapped segment. The creator owns the name: it unlinks on ``unlink()``, and
  if it dies first, the multiprocessing resource tracker (a separate process that outlives it)
  unlinks the name. Attachers never register with a tracker, so attaching cannot unlink someone
  else's segment (the Python 3.11 pitfall of ``SharedMemory(name=...)``).
* ``namespace_id()``: equal in two processes exactly when they see the same ``/dev/shm``.
* ``ShmTensorHandle``: the seed's one-tensor handoff, publish -> attach -> consume | release.
  ``publish(tensor, purpose="intake")`` makes the only kind of segment an encode worker's intake
  will read (and unlink): its name starts with ``epd-in-``, and no other creator may use that
  prefix, so a client naming anything else (a prefill's receive pool, a handoff) is refused
  before ``/dev/shm`` is touched (``ShmTensorHandle.for_intake``).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from functools import cache
from multiprocessing import resource_tracker

import torch

from epdserve.data_plane.dtypes import dtype_from_wire, dtype_to_wire

SHM_DIR = "/dev/shm"
NAME_PREFIX = "epd-"
_NAME_RE = re.compile(r"^epd-[A-Za-z0-9_-]{1,100}$")
# what each purpose's segments are named; the intake kind is reserved to publish(purpose="intake")
PURPOSE_KINDS = {"handoff": "h", "intake": "in"}
INTAKE_PREFIX = f"{NAME_PREFIX}{PURPOSE_KINDS['intake']}-"
# receive pools (MemoryRegion.shared): the only segments a writer writes into
POOL_PREFIX = f"{NAME_PREFIX}pool-"


class ShmError(OSError):
    """A shared-memory segment could not be created, opened or used."""


def validate_name(name: str) -> str:
    """Return ``name`` if it is one of ours: ``epd-`` plus 1-100 of ``[A-Za-z0-9_-]``."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid SHM segment name {name!r}: expected {_NAME_RE.pattern}")
    return name


def new_name(kind: str) -> str:
    return validate_name(f"{NAME_PREFIX}{kind}-{os.getpid()}-{secrets.token_hex(8)}")


def is_pool_name(name: str) -> bool:
    """Whether ``name`` is a receive pool's (``MemoryRegion.shared`` makes them)."""
    return isinstance(name, str) and name.startswith(POOL_PREFIX) and bool(_NAME_RE.fullmatch(name))


def is_intake_name(name: str) -> bool:
    """Whether ``name`` is an intake handle's: ``epd-in-`` plus the producer's pid and a random
    part (``publish(..., purpose="intake")`` is the only creator of such names)."""
    return (
        isinstance(name, str) and name.startswith(INTAKE_PREFIX) and bool(_NAME_RE.fullmatch(name))
    )


@cache
def namespace_id() -> str:
    """Boot id plus the device of ``/dev/shm``: equal iff two processes share the same tmpfs."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return f"{boot_id}:{os.stat(SHM_DIR).st_dev}"


def _tracker_name(name: str) -> str:
    return "/" + name


class ShmSegment:
    """A mapped ``/dev/shm`` segment; ``tensor`` is a uint8 view of all of it, ``array`` the same
    as numpy (for copies through numpy: ``data_plane.transport.byte_array``)."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap = mapping
        self.tensor = (
            torch.frombuffer(mapping, dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        self.array = self.tensor.numpy()

    @classmethod
    def create(cls, size: int, kind: str = "seg", name: str | None = None) -> ShmSegment:
        """Create, reserve (ENOSPC now, not SIGBUS later) and map a new segment we own. Intake
        names are refused here: only ``ShmTensorHandle.publish(..., purpose="intake")`` makes
        them."""
        name = validate_name(name) if name is not None else new_name(kind)
        if name.startswith(INTAKE_PREFIX):
            raise ValueError(f"{name}: {INTAKE_PREFIX}* names are reserved for intake handles")
        return cls._create(size, name)

    @classmethod
    def _create(cls, size: int, name: str) -> ShmSegment:
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            resource_tracker.register(_tracker_name(name), "shared_memory")
            try:
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size)
            except BaseException as exc:
                os.unlink(path)
                resource_tracker.unregister(_tracker_name(name), "shared_memory")
                if isinstance(exc, OSError):
                    raise ShmError(
                        exc.errno, f"cannot create {size}-byte SHM segment {name}: {exc.strerror}"
                    ) from exc
                raise
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=True)

    @classmethod
    def attach(cls, name: str, min_size: int = 0, exact: bool = False) -> ShmSegment:
        """Map an existing segment by name; refuses links, non-files, other users' and short ones
        (with ``exact``, any other size than ``min_size``)."""
        validate_name(name)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot open SHM segment {name}: {exc.strerror}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ShmError(f"SHM segment {name} is not a regular file")
            if info.st_uid != os.geteuid():
                raise ShmError(f"SHM segment {name} belongs to uid {info.st_uid}, not to us")
            if info.st_size < max(min_size, 1) or (exact and info.st_size != max(min_size, 1)):
                raise ShmError(
                    f"SHM segment {name} has {info.st_size} bytes, "
                    f"need {'exactly ' if exact else ''}{max(min_size, 1)}"
                )
            mapping = mmap.mmap(fd, info.st_size)
        finally:
            os.close(fd)
        return cls(name, info.st_size, mapping, owner=False)

    def unlink(self) -> None:
        """Remove the name (owner only); mappings stay valid until closed."""
        if not self.owner:
            raise ShmError(f"only the creator may unlink SHM segment {self.name}")
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        resource_tracker.unregister(_tracker_name(self.name), "shared_memory")
        self.owner = False

    def close(self) -> None:
        """Drop this process's reference to the mapping. It is unmapped once no tensor views it:
        torch views keep the mmap object alive, but ``mmap.close()`` would unmap under them
        (it does not refuse while a ``torch.frombuffer`` view exists), so it is never called."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self._mmap = None


@dataclass
class ShmTensorHandle:
    """Pickle-safe handle to a CPU tensor in its own SHM segment (used for pixels on one node).

    ``publish`` copies the tensor into a new segment and hands the name over; ``attach`` maps it
    (every consumer rank, before any barrier); ``consume`` copies it out and unlinks;
    ``release`` unlinks without reading. An attached consumer that dies before consuming leaves
    no segment: attaching registers the name with the consumer's resource tracker.

    Purposes: ``"handoff"`` (the seed's, between an engine's ranks) and ``"intake"`` (pixels for
    an encode worker on this node). A handle that arrives at intake is built by ``for_intake``,
    which refuses every name but an intake handle's, and attaches only to a segment of exactly
    the handle's size (what ``publish`` made), ours, and a regular file.
    """

    shm_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    _segment: ShmSegment | None = field(default=None, init=False, repr=False, compare=False)
    _exact: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_name(self.shm_name)
        dtype_to_wire(self.dtype)
        if any(int(d) < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= int(dim)
        return count * self.dtype.itemsize

    @classmethod
    def publish(cls, tensor: torch.Tensor, purpose: str = "handoff") -> ShmTensorHandle:
        if purpose not in PURPOSE_KINDS:
            raise ValueError(
                f"unknown SHM handle purpose {purpose!r}; expected one of {sorted(PURPOSE_KINDS)}"
            )
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        segment = ShmSegment._create(max(flat.numel(), 1), new_name(PURPOSE_KINDS[purpose]))
        try:
            segment.tensor[: flat.numel()].copy_(flat)
        except BaseException:
            segment.unlink()
            segment.close()
            raise
        # Ownership passes to the consumer: forget the name without unlinking it.
        resource_tracker.unregister(_tracker_name(segment.name), "shared_memory")
        segment.owner = False
        segment.close()
        return cls(shm_name=segment.name, shape=tuple(tensor.shape), dtype=tensor.dtype)

    @classmethod
    def for_intake(
        cls, shm_name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> ShmTensorHandle:
        """A handle named by an intake message; ``ValueError`` unless the name is an intake
        handle's (checked on the name alone: nothing in ``/dev/shm`` is touched)."""
        if not is_intake_name(shm_name):
            raise ValueError(
                f"SHM segment {shm_name!r} is not an intake handle (intake reads only "
                f"{INTAKE_PREFIX}* segments, made by ShmTensorHandle.publish(..., "
                "purpose='intake'))"
            )
        handle = cls(shm_name=shm_name, shape=shape, dtype=dtype)
        handle._exact = True
        return handle

    def to_wire(self) -> dict:
        return {
            "shm_name": self.shm_name,
            "shape": list(self.shape),
            "dtype": dtype_to_wire(self.dtype),
        }

    @classmethod
    def from_wire(cls, data: dict) -> ShmTensorHandle:
        return cls(
            shm_name=data["shm_name"],
            shape=tuple(int(d) for d in data["shape"]),
            dtype=dtype_from_wire(data["dtype"]),
        )

    def attach(self) -> None:
        if self._segment is None:
            segment = ShmSegment.attach(self.shm_name, min_size=self.nbytes, exact=self._exact)
            resource_tracker.register(_tracker_name(self.shm_name), "shared_memory")
            segment.owner = True
            self._segment = segment

    def consume(self) -> torch.Tensor:
        """Copy the tensor out, unmap and unlink. ``attach()`` must have run."""
        segment = self._segment
        if segment is None:
            raise RuntimeError(
                f"ShmTensorHandle({self.shm_name!r}) must be attach()'d before consume() "
                "(or was already consumed here)"
            )
        self._segment = None
        try:
            pin = torch.cuda.is_available()
            out = torch.empty(self.shape, dtype=self.dtype, pin_memory=pin)
            out.view(-1).view(torch.uint8).copy_(segment.tensor[: self.nbytes])
        finally:
            segment.unlink()
            segment.close()
        return out

    def release(self) -> None:
        """Unlink without reading (a deduplicated alias); safe if already gone."""
        segment = self._segment
        self._segment = None
        if segment is None:
            try:
                segment = ShmSegment.attach(self.shm_name)
            except ShmError:
                return
            segment.owner = True
            resource_tracker.register(_tracker_name(self.shm_name), "shared_memory")
        segment.unlink()
        segment.close()
