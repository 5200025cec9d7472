"""Where each image of a request is encoded, and why: on an encode worker, or inline by vLLM's
own tower. An image no worker took goes inline; one the workers refused only as busy (its wait
there past its deadline) overflows inline while vLLM's tower has room under ``--max-inline-
patches`` (``InlineBudget``: the patches of the images vLLM encodes inline at once, so a burst
does not move the whole encode load onto the prefill GPU), and is refused (503) past it. Every
decision is counted by route and reason (``epd_gateway_placements_total{route,reason}``) and said
in the answer's ``epd`` report. ``--placement min-items=N`` (SGLang's static rule) sends a request
of fewer than N distinct images to vLLM inline whole."""

from __future__ import annotations

import enum
import math
import re

from epdserve.dispatcher.media import DispatchedItem


class Route(str, enum.Enum):
    ENCODE_WORKER = "encode_worker"
    VLLM = "vllm"  # inline: vLLM's own tower
    REFUSED = "refused"  # the request refused (503): neither route can take it in time


class Reason(str, enum.Enum):
    PLACED = "placed"  # an encode worker took it
    FEW_ITEMS = "few_items"  # --placement min-items=N: a request of fewer images
    WORKERS_BUSY = "workers_busy"  # every worker would keep it past its deadline: overflow
    INLINE_FULL = "inline_full"  # ... and vLLM encodes --max-inline-patches inline already
    FORMAT = "format"  # a format no worker decodes
    NO_HEALTHY_WORKER = "no_healthy_worker"
    NO_COMPATIBLE_WORKER = "no_compatible_worker"  # the workers serve another model
    DISPATCH_FAILED = "dispatch_failed"  # the workers tried refused it (not busy) or failed
    ENCODE_FAILED = "encode_failed"  # its worker failed it after taking it
    DELIVERY_FAILED = "delivery_failed"  # its delivery failed inside vLLM (retried inline)


# --placement: ``workers`` (every image an encode worker takes), or SGLang's static rule
# ``min-items=N`` (a request of fewer than N distinct images is encoded by vLLM inline)
PLACEMENT_PATTERN = r"^(workers|min-items=[1-9][0-9]{0,2})$"


def min_items(placement: str) -> int:
    """The fewest distinct images a request needs for them to go to the encode workers."""
    match = re.fullmatch(r"min-items=(\d+)", placement)
    return int(match.group(1)) if match else 1


def patches(item: DispatchedItem) -> int:
    """The tower's input patches for the item (its grid's product)."""
    return math.prod(item.grid_thw)


def busy(item: DispatchedItem) -> bool:
    """Whether the workers refused the item only as busy (with when to retry)."""
    return item.worker is None and item.retry_after_s is not None


class InlineBudget:
    """The patches vLLM encodes inline at once: overflow takes from it only up to ``max_patches``
    (0: never overflow); an image that must go inline for another reason (no worker can encode
    it) is counted without a limit. Released when the request's prefill is over (its first
    token, its answer, or its end)."""

    def __init__(self, max_patches: int):
        self.max_patches = max_patches
        self.patches = 0  # held now
        self.peak = 0  # the most held at once

    def overflow(self, wanted: int) -> bool:
        """Take ``wanted`` patches of overflow if they fit under the cap."""
        if self.patches + wanted > self.max_patches:
            return False
        self.hold(wanted)
        return True

    def hold(self, wanted: int) -> None:
        self.patches += wanted
        self.peak = max(self.peak, self.patches)

    def release(self, held: int) -> None:
        if held > self.patches:
            raise ValueError(f"releasing {held} inline patches of {self.patches} held")
        self.patches -= held
