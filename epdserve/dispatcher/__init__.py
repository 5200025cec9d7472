"""The gateway's part of EPD: split a request into items, route each to an encode worker by
content hash, name its room (the worker's intake opens it), send its bytes, and hand back the
prefill request's items.

Its names load when first asked for (``from epdserve.dispatcher import Dispatcher``): a process
that only reads its settings (``dispatcher.settings``, ``dispatcher.workers``) loads no torch, so
a mistake on a command line is answered at once."""

import importlib

_WHERE = {
    "Dispatcher": "epdserve.dispatcher.dispatch",
    "DispatchError": "epdserve.dispatcher.media",
    "DispatchedItem": "epdserve.dispatcher.media",
    "HashRing": "epdserve.dispatcher.ring",
    "WorkerAddress": "epdserve.dispatcher.workers",
    "WorkerSet": "epdserve.dispatcher.workers",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
