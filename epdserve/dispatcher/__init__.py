"""The gateway's part of EPD: split a request into items, route each to an encode worker by
content hash, name its room (the worker's intake opens it), send its bytes, and hand back the
prefill request's items."""

from epdserve.dispatcher.dispatch import Dispatcher
from epdserve.dispatcher.media import DispatchedItem, DispatchError
from epdserve.dispatcher.ring import HashRing
from epdserve.dispatcher.workers import WorkerAddress, WorkerSet

__all__ = [
    "DispatchError",
    "DispatchedItem",
    "Dispatcher",
    "HashRing",
    "WorkerAddress",
    "WorkerSet",
]
