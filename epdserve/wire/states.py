"""The receive side's vocabulary, as reports and responses spell it: a receive job's state and each
item's."""

from __future__ import annotations

import enum


class JobState(enum.StrEnum):
    PENDING = "PENDING"  # an item is not settled yet
    DONE = "DONE"  # every item settled, none failed
    FAILED = "FAILED"  # every item settled, one or more failed


class ItemState(enum.StrEnum):
    PENDING = "PENDING"  # not settled yet
    DONE = "DONE"  # rows published in the item's ``encoded`` (received, or the local tower's)
    FAILED = "FAILED"  # the outcome's ``reason`` says why
    SKIPPED = (
        "SKIPPED"  # no room: not the receiver's to fill (epd-prefill's own tower may encode it)
    )
