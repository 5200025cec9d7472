"""The prefill side: the receiver library an engine embeds to fill each item's ``encoded`` rows
from encode workers (SHM on the same node, Mooncake otherwise), with fallback and fast failure."""

from prefill_side.receiver import ItemOutcome, PrefillReceiver, ReceiveJob, ReceiverConfig
from wire.states import ItemState, JobState

__all__ = [
    "ItemOutcome",
    "ItemState",
    "JobState",
    "PrefillReceiver",
    "ReceiveJob",
    "ReceiverConfig",
]
