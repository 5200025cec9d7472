"""The prefill side: the receiver library an engine embeds to fill each item's ``encoded`` rows
from encode workers (SHM on the same node, Mooncake otherwise), with fallback and fast failure.
Importing it loads no encode worker, dispatcher, gateway or HTTP server; the local tower's vision
stack only where the fallback runs. Its names load when first asked for, so a process that reads
only the receiver's settings (``prefill_side.settings``) loads no torch."""

import importlib

_WHERE = {
    "ItemOutcome": "prefill_side.job",
    "ItemState": "epdserve.wire.states",
    "JobState": "epdserve.wire.states",
    "PrefillReceiver": "prefill_side.receiver",
    "ReceiveJob": "prefill_side.job",
    "ReceiverConfig": "prefill_side.settings",
    "ReceiverSettings": "prefill_side.settings",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
