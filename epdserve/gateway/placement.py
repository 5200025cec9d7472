"""Where each image of a request is encoded, and why: on an encode worker, or inline by vLLM's
own tower. An image no worker took goes inline; one the workers refused only as busy (its wait
there past its deadline) overflows inline while vLLM's tower has room under ``--max-inline-
patches`` (``InlineBudget``: the patches of the images vLLM encodes inline at once, so a burst
does not move the whole encode load onto the prefill GPU), and is refused (503) past it. Every
decision is counted by route and reason (``epd_gateway_placements_total{route,reason}``) and said
in the answer's ``epd`` report. ``--placement min-items=N`` (SGLang's static rule) sends a request
of fewer than N distinct images to vLLM inline whole.

``--placement cost`` (``PlacementCosts``) predicts, for each request with images, its time to first
token by each route, and takes the sooner: via the encode workers, the median of the recent
requests whose images all went there (their queue wait, encode, transfer and the prefill, as the
gateway measured them); via vLLM's own tower, the same median of the requests encoded inline, plus
the inline patches vLLM encodes ahead of it at that route's measured pace. Both are learned per
size class (the request's patches), start from conservative priors (the workers sooner), and
every ``PROBE_EVERY``-th decision, while vLLM encodes nothing inline, takes the other route so
that its cost stays measured (a route
that became slower or faster is seen within a few requests). The predictions of the routes are
in the ``epd`` report per image; the measured over the predicted time is a histogram."""

from __future__ import annotations

import bisect
import collections
import enum
import math
import re
import statistics
from dataclasses import dataclass

from epdserve.dispatcher.media import DispatchedItem


class Route(str, enum.Enum):
    ENCODE_WORKER = "encode_worker"
    VLLM = "vllm"  # inline: vLLM's own tower
    REFUSED = "refused"  # the request refused (503): neither route can take it in time


class Reason(str, enum.Enum):
    PLACED = "placed"  # an encode worker took it
    FEW_ITEMS = "few_items"  # --placement min-items=N: a request of fewer images
    SOONER = "sooner"  # --placement cost: the route predicted sooner
    PROBE = "probe"  # --placement cost: the other route, so that its cost stays measured
    WORKERS_BUSY = "workers_busy"  # every worker would keep it past its deadline: overflow
    # vLLM encodes --max-inline-patches inline already: refused (the workers busy), or to the
    # workers (--placement cost predicted vLLM sooner)
    INLINE_FULL = "inline_full"
    FORMAT = "format"  # a format no worker decodes
    NO_HEALTHY_WORKER = "no_healthy_worker"
    NO_COMPATIBLE_WORKER = "no_compatible_worker"  # the workers serve another model
    DISPATCH_FAILED = "dispatch_failed"  # the workers tried refused it (not busy) or failed
    ENCODE_FAILED = "encode_failed"  # its worker failed it after taking it
    DELIVERY_FAILED = "delivery_failed"  # its delivery failed inside vLLM (retried inline)


# --placement: ``workers`` (every image an encode worker takes), ``cost`` (the route predicted
# sooner), or SGLang's static rule ``min-items=N`` (a request of fewer than N distinct images is
# encoded by vLLM inline)
PLACEMENT_PATTERN = r"^(workers|cost|min-items=[1-9][0-9]{0,2})$"
COST = "cost"
# size classes: the upper bounds of a request's tower patches (a 448x448 image has 1,024)
SIZE_CLASSES = (1024, 4096, 16384, 65536)
COST_WINDOW = 8  # the recent observations a route's cost is the median of, per size class
PROBE_EVERY = 16  # every PROBE_EVERY-th decision takes the route predicted later
# conservative priors (seconds to the first token, and per patch): the workers until measured,
# vLLM's tower (which encodes in the engine's steps) slow until measured
PRIOR_S = {"encode_worker": 0.5, "vllm": 5.0}
PRIOR_S_PER_PATCH = {"encode_worker": 2e-4, "vllm": 1e-3}


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


def size_class(patches: int) -> str:
    """The size class of ``patches`` (a metric label): its upper bound, or ``larger``."""
    at = bisect.bisect_left(SIZE_CLASSES, patches)
    return str(SIZE_CLASSES[at]) if at < len(SIZE_CLASSES) else "larger"


@dataclass(frozen=True)
class Prediction:
    """A request's time to first token predicted by each route, and the route taken."""

    encode_worker_s: float
    vllm_s: float
    route: Route
    reason: Reason

    @property
    def taken_s(self) -> float:
        return self.encode_worker_s if self.route is Route.ENCODE_WORKER else self.vllm_s


class PlacementCosts:
    """Each route's time to first token, learned online: the median of its last ``COST_WINDOW``
    observations per size class (a request's patches), and the seconds per patch they imply;
    a prior until the first observation."""

    ROUTES = (Route.ENCODE_WORKER, Route.VLLM)

    def __init__(self):
        self._seen: dict[tuple[Route, str], collections.deque[tuple[float, int]]] = {}
        self.decisions = 0

    def cost_s(self, route: Route, patches: int) -> float:
        """The predicted time to first token of a request of ``patches`` by ``route``."""
        seen = self._seen.get((route, size_class(patches)))
        if not seen:
            return PRIOR_S[route.value] + PRIOR_S_PER_PATCH[route.value] * patches
        return statistics.median(seconds for seconds, _ in seen)

    def pace_s(self, route: Route, patches: int) -> float:
        """Seconds per patch by ``route`` for a request of ``patches`` (its size class's)."""
        seen = self._seen.get((route, size_class(patches)))
        if not seen:
            return PRIOR_S_PER_PATCH[route.value]
        return statistics.median(seconds / max(1, held) for seconds, held in seen)

    def decide(self, patches: int, inline_patches: int) -> Prediction:
        """The route for a request of ``patches`` while vLLM encodes ``inline_patches`` inline
        for other requests: the one predicted sooner, or every ``PROBE_EVERY``-th time the
        other, unless vLLM encodes inline for others already (a probe in a burst would slow
        every request in the engine)."""
        workers_s = self.cost_s(Route.ENCODE_WORKER, patches)
        vllm_s = self.cost_s(Route.VLLM, patches) + inline_patches * self.pace_s(
            Route.VLLM, patches
        )
        sooner = Route.ENCODE_WORKER if workers_s <= vllm_s else Route.VLLM
        self.decisions += 1
        if self.decisions % PROBE_EVERY == 0 and inline_patches == 0:
            later = Route.VLLM if sooner is Route.ENCODE_WORKER else Route.ENCODE_WORKER
            return Prediction(workers_s, vllm_s, later, Reason.PROBE)
        return Prediction(workers_s, vllm_s, sooner, Reason.SOONER)

    def observe(self, route: Route, patches: int, seconds: float) -> None:
        """A request of ``patches`` whose images all took ``route`` had its first token after
        ``seconds``."""
        key = (route, size_class(patches))
        self._seen.setdefault(key, collections.deque(maxlen=COST_WINDOW)).append((seconds, patches))

    def costs(self) -> dict[tuple[str, str], float]:
        """Each route's learned cost per size class observed (the metric's values)."""
        return {
            (route.value, label): statistics.median(seconds for seconds, _ in seen)
            for (route, label), seen in self._seen.items()
        }
