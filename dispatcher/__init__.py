"""The gateway's part of EPD: split a request into items, route each to an encode worker by
content hash, name its room (the worker's intake opens it), send its bytes, and hand back the
prefill request's items."""

from dispatcher.dispatch import Dispatcher
from dispatcher.media import DispatchedItem, DispatchError
from dispatcher.ring import HashRing
from dispatcher.workers import WorkerAddress, WorkerSet

__all__ = [
    "DispatchError",
    "DispatchedItem",
    "Dispatcher",
    "HashRing",
    "WorkerAddress",
    "WorkerSet",
]
