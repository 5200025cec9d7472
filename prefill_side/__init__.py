"""The prefill side: the receiver library an engine embeds to fill each item's ``encoded`` rows
from encode workers (SHM on the same node, Mooncake otherwise), with fallback and fast failure.
Importing it loads no encode worker, dispatcher, gateway or HTTP server; the local tower's vision
stack only where the fallback runs."""

from epdserve.wire.states import ItemState, JobState
from prefill_side.job import ItemOutcome, ReceiveJob
from prefill_side.receiver import PrefillReceiver
from prefill_side.settings import ReceiverConfig, ReceiverSettings

__all__ = [
    "ItemOutcome",
    "ItemState",
    "JobState",
    "PrefillReceiver",
    "ReceiveJob",
    "ReceiverConfig",
    "ReceiverSettings",
]
