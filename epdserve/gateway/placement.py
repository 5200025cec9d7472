"""Where each image of a request is encoded, and why: on an encode worker, or inline by vLLM's
own tower. An image no worker took goes inline; one the workers refused only as busy (its wait
there past its deadline) overflows inline while vLLM's tower has room under ``--max-inline-
patches`` (``InlineBudget``: the patches of the images vLLM encodes inline at once, so a burst
does not move the whole encode load onto the prefill GPU), and is refused (503) past it. Every
decision is counted by route and reason (``epd_gateway_placements_total{route,reason}``) and said
in the answer's ``epd`` report. ``--placement min-items=N`` (SGLang's static rule) sends a request
of fewer than N distinct images to vLLM inline whole. ``Placements`` takes and records these
decisions for each request.

``--placement cost`` (``PlacementCosts``) predicts, for each request with images, its time to first
token by each route, and takes the sooner: via the encode workers, the median of the recent
requests whose images all went there (their queue wait, encode, transfer and the prefill, as the
gateway measured them); via vLLM's own tower, the same median of the requests encoded inline,
each scaled from the engine's load it was measured under to the load now (``EngineLoad``: the
requests running and waiting in vLLM, as vLLM's ``/metrics`` says or the gateway counts; the
tower encodes in the engine's steps, which it shares with each of them), plus the inline patches
vLLM encodes ahead of it at that route's measured pace. Both are learned per
size class (the request's patches) and start from conservative priors (the workers sooner);
while vLLM encodes nothing inline, a decision takes the route predicted later (a probe) where that
route is not yet measured in the size class and the other is, one such probe at a time (so a
wrong prior is corrected by the first decision of a class after its first measurement; requests
decided before it, as in a burst, go by the prior), and every ``PROBE_EVERY``-th decision, so
that its cost stays measured (a route that became slower or faster is seen within a few
requests). The predictions of the routes are in the ``epd`` report per image; the measured over
the predicted time, for a route measured (not a prior), is a histogram."""

from __future__ import annotations

import bisect
import collections
import enum
import math
import re
import statistics
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from epdserve.dispatcher.media import DispatchedItem
from epdserve.dispatcher.workers import INCOMPATIBLE, READY
from epdserve.gateway.errors import OpenAIError

if TYPE_CHECKING:
    from epdserve.gateway.engine_load import EngineLoad
    from epdserve.gateway.metrics import GatewayMetrics
    from epdserve.gateway.prepared import PreparedChat


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
    engine_load: int = 0  # the requests in vLLM when it was predicted
    patches: int = 0  # of the request's images a worker could encode: its size class's
    measured: bool = True  # the taken route's cost was measured in the size class (not a prior)
    probed: Route | None = None  # the route probed as not yet measured in the size class

    @property
    def taken_s(self) -> float:
        return self.encode_worker_s if self.route is Route.ENCODE_WORKER else self.vllm_s


def load_scale(route: Route, now: int, then: int) -> float:
    """How many times as long ``route`` takes with ``now`` other requests in vLLM as it took
    with ``then``: vLLM's own tower encodes in the engine's steps, shared with each of them;
    the workers' route is taken as measured."""
    return (1 + now) / (1 + then) if route is Route.VLLM else 1.0


@dataclass(frozen=True)
class Observation:
    """A request's time to first token by one route, its patches, and the requests in vLLM
    when it was decided."""

    seconds: float
    patches: int
    engine_load: int


class PlacementCosts:
    """Each route's time to first token, learned online: the median of its last ``COST_WINDOW``
    observations per size class (a request's patches), and the seconds per patch they imply;
    a prior until the first observation. vLLM's own tower's is scaled by the engine's load: a
    request measured with ``m`` others in vLLM is predicted to take ``(1 + n) / (1 + m)`` times
    as long with ``n``."""

    ROUTES = (Route.ENCODE_WORKER, Route.VLLM)

    def __init__(self):
        self._seen: dict[tuple[Route, str], collections.deque[Observation]] = {}
        # (route, size class) probed as unmeasured, its first observation not in yet
        self._probing: set[tuple[Route, str]] = set()
        self.decisions = 0

    def cost_s(self, route: Route, patches: int, engine_load: int = 0) -> float:
        """The predicted time to first token of a request of ``patches`` by ``route`` with
        ``engine_load`` other requests in vLLM."""
        seen = self._seen.get((route, size_class(patches)))
        if not seen:
            prior = PRIOR_S[route.value] + PRIOR_S_PER_PATCH[route.value] * patches
            return prior * load_scale(route, engine_load, 0)
        return statistics.median(
            each.seconds * load_scale(route, engine_load, each.engine_load) for each in seen
        )

    def pace_s(self, route: Route, patches: int) -> float:
        """Seconds per patch by ``route`` for a request of ``patches`` (its size class's)."""
        seen = self._seen.get((route, size_class(patches)))
        if not seen:
            return PRIOR_S_PER_PATCH[route.value]
        return statistics.median(each.seconds / max(1, each.patches) for each in seen)

    def decide(self, patches: int, inline_patches: int, engine_load: int = 0) -> Prediction:
        """The route for a request of ``patches`` while vLLM encodes ``inline_patches`` inline
        for other requests and has ``engine_load`` requests running and waiting: the one
        predicted sooner, or the other (a probe) where it is not yet measured in the size class
        while the sooner is, and every ``PROBE_EVERY``-th time; no probe while vLLM encodes
        inline for others already (a probe in a burst would slow every request in the engine)."""
        workers_s = self.cost_s(Route.ENCODE_WORKER, patches)
        vllm_s = self.cost_s(Route.VLLM, patches, engine_load) + inline_patches * self.pace_s(
            Route.VLLM, patches
        )
        sooner = Route.ENCODE_WORKER if workers_s <= vllm_s else Route.VLLM
        later = Route.VLLM if sooner is Route.ENCODE_WORKER else Route.ENCODE_WORKER
        self.decisions += 1
        label = size_class(patches)
        unmeasured = (
            self.measured(sooner, patches)
            and not self.measured(later, patches)
            and (later, label) not in self._probing
        )
        route, reason, probed = sooner, Reason.SOONER, None
        if inline_patches == 0 and (unmeasured or self.decisions % PROBE_EVERY == 0):
            route, reason = later, Reason.PROBE
            if unmeasured:
                self._probing.add((later, label))
                probed = later
        measured = self.measured(route, patches)
        return Prediction(workers_s, vllm_s, route, reason, engine_load, patches, measured, probed)

    def measured(self, route: Route, patches: int) -> bool:
        """Whether ``route``'s cost is measured in the size class of ``patches`` (not a prior)."""
        return (route, size_class(patches)) in self._seen

    def settle(self, prediction: Prediction) -> None:
        """``prediction``'s request has ended: a probe of a route not yet measured that taught
        nothing (the request failed, or its images went another way) lets the next decision of
        its size class probe again."""
        if prediction.probed is not None:
            self._probing.discard((prediction.probed, size_class(prediction.patches)))

    def observe(self, route: Route, patches: int, seconds: float, engine_load: int = 0) -> None:
        """A request of ``patches`` whose images all took ``route`` had its first token after
        ``seconds``, decided with ``engine_load`` requests in vLLM."""
        key = (route, size_class(patches))
        self._seen.setdefault(key, collections.deque(maxlen=COST_WINDOW)).append(
            Observation(seconds, patches, engine_load)
        )
        self._probing.discard(key)

    def costs(self) -> dict[tuple[str, str], float]:
        """Each route's learned cost per size class observed, as measured (the metric's
        values)."""
        return {
            (route.value, label): statistics.median(each.seconds for each in seen)
            for (route, label), seen in self._seen.items()
        }


class Placements:
    """Each request's placements, as the gateway decides and records them: an image's route and
    reason counted (and kept for the request's ``epd`` report), the patches of the images vLLM
    encodes inline held in the ``InlineBudget`` until the request's prefill is over,
    ``--placement``'s decisions taken before any worker is asked, busy workers' images overflowed
    inline or the request refused, and (``--placement cost``) each route's time to first token
    learned from the requests whose images all took it, with the engine's load then."""

    def __init__(
        self,
        placement: str,
        inline: InlineBudget,
        costs: PlacementCosts,
        metrics: GatewayMetrics,
        load: EngineLoad,
    ):
        """``placement``: ``--placement``'s value (``PLACEMENT_PATTERN``); ``load``: the
        requests in vLLM now."""
        self.placement = placement
        self.inline = inline
        self.costs = costs
        self.metrics = metrics
        self.load = load

    def decided_inline(self, prepared: PreparedChat) -> bool:
        """Whether the request's images go to vLLM inline before any worker is asked: fewer
        than ``--placement min-items=N`` (every image), or predicted sooner there
        (``--placement cost``: every image a worker could encode)."""
        if len(prepared.items) < min_items(self.placement):
            for item in prepared.items:  # vLLM encodes them: nothing is sent to the workers
                self.send_inline(prepared, item, Reason.FEW_ITEMS)
            return True
        return self._predicted_inline(prepared)

    def _predicted_inline(self, prepared: PreparedChat) -> bool:
        """``--placement cost``: whether the request's images go to vLLM inline, predicted
        sooner there (or probed) and within ``--max-inline-patches`` (else to the workers,
        ``inline_full``), then counted; the prediction kept for its report and for its error
        once the first token came."""
        if self.placement != COST:
            return False
        encodable = [item for item in prepared.items if not item.encoded_by_vllm]
        if not encodable:
            return False
        wanted = sum(patches(item) for item in encodable)
        prepared.prediction = self.costs.decide(wanted, self.inline.patches, self.load.others())
        if prepared.prediction.route is not Route.VLLM:
            return False
        if not self.inline.overflow(wanted):  # vLLM encodes --max-inline-patches inline already
            prepared.prediction = replace(
                prepared.prediction,
                route=Route.ENCODE_WORKER,
                reason=Reason.INLINE_FULL,
                measured=self.costs.measured(Route.ENCODE_WORKER, wanted),
            )
            return False
        for item in encodable:
            self.send_inline(prepared, item, prepared.prediction.reason, held=True)
        return True

    def overflow(self, prepared: PreparedChat) -> None:
        """The items every worker refused as busy (their wait there past their deadline) go to
        vLLM inline if their patches fit under ``--max-inline-patches`` with those vLLM encodes
        inline already; else the request is refused whole (``OpenAIError`` 503, with when to
        retry: the encode tier is up and will take it later), and the caller cancels its
        placed items' rooms."""
        refused = [item for item in prepared.items if busy(item)]
        if not refused:
            return
        if self.inline.overflow(sum(patches(item) for item in refused)):
            for item in refused:
                item.error = f"the encode workers are busy ({item.error}); vLLM encoded it"
                self.send_inline(prepared, item, Reason.WORKERS_BUSY, held=True)
            return
        for item in refused:
            self.metrics.placed(Route.REFUSED.value, Reason.INLINE_FULL.value)
        raise OpenAIError(
            503,
            f"{len(refused)} of the request's {len(prepared.items)} images cannot be encoded "
            "within their deadline: the encode workers are busy and vLLM encodes "
            f"{self.inline.patches} patches inline already (--max-inline-patches "
            f"{self.inline.max_patches}); retry later",
            kind="overloaded",
            retry_after_s=max(1, math.ceil(min(item.retry_after_s for item in refused))),
        )

    def dispatched(self, prepared: PreparedChat, worker_states: dict[str, int]) -> None:
        """Each image the dispatcher placed recorded with its worker's route; each other one not
        decided yet goes to vLLM inline, with why no worker took it (``worker_states``: the
        encode workers by state now)."""
        for item in prepared.items:
            if item.worker is not None:
                decided = prepared.prediction
                reason = decided.reason if decided is not None else Reason.PLACED
                self._placed(prepared, item, Route.ENCODE_WORKER, reason)
            elif item.index not in prepared.reasons:  # (overflow is decided already)
                reason = (
                    Reason.FORMAT
                    if item.encoded_by_vllm
                    else Reason.DISPATCH_FAILED
                    if item.attempts
                    else Reason.NO_COMPATIBLE_WORKER
                    if worker_states[INCOMPATIBLE] and not worker_states[READY]
                    else Reason.NO_HEALTHY_WORKER
                )
                self.send_inline(prepared, item, reason)

    def _placed(
        self,
        prepared: PreparedChat,
        item: DispatchedItem,
        route: Route,
        reason: Reason,
        moved: bool = False,
    ) -> None:
        """Where the item goes and why, counted (``moved``: a placed item sent inline after
        all: a placement again, not another image)."""
        prepared.reasons[item.index] = reason
        self.metrics.placed(route.value, reason.value)
        if not moved:
            encoder = "encode_worker" if route is Route.ENCODE_WORKER else "colocated"
            self.metrics.images.labels(self.metrics.model_name, encoder).inc()

    def send_inline(
        self,
        prepared: PreparedChat,
        item: DispatchedItem,
        reason: Reason,
        held: bool = False,
        moved: bool = False,
    ) -> None:
        """The item goes to vLLM inline: counted, and its patches held until the request's
        prefill is over (``held``: taken from the budget already)."""
        self._placed(prepared, item, Route.VLLM, reason, moved)
        self.metrics.colocated.labels(self.metrics.model_name, reason.value).inc()
        if not held:
            self.inline.hold(patches(item))
        prepared.inline_patches += patches(item)

    def ended(self, prepared: PreparedChat) -> None:
        """The request has ended (answered or not): once. Its inline patches are released, and
        a probe it was is settled."""
        self.release_inline(prepared)
        if prepared.prediction is not None:
            self.costs.settle(prepared.prediction)

    def release_inline(self, prepared: PreparedChat) -> None:
        """The request's prefill is over (its first token, its answer, or its end): vLLM
        encodes its inline items no more. Once per request."""
        self.inline.release(prepared.inline_patches)
        prepared.inline_patches = 0

    def first_token(self, prepared: PreparedChat, started: float) -> None:
        """The request's first token (or answer) came: its time counted, and learned as its
        route's cost where all its images took one route."""
        seconds = time.monotonic() - started
        self.metrics.first_token.labels(self.metrics.model_name).observe(seconds)
        if not prepared.items:
            return
        placed = len(prepared.placed)
        if 0 < placed < len(prepared.items):
            return  # both routes: the time is neither's
        route = Route.ENCODE_WORKER if placed else Route.VLLM
        prediction = prepared.prediction
        # the load it was decided under; else the others in vLLM now
        engine_load = prediction.engine_load if prediction is not None else self.load.others()
        # the size class it was decided in; else every image's patches
        wanted = (
            prediction.patches
            if prediction is not None
            else sum(patches(item) for item in prepared.items)
        )
        self.costs.observe(route, wanted, seconds, engine_load)
        self.metrics.costs_now(self.costs.costs())
        # the model's error: a prediction from measurements (a prior is no model's)
        if (
            prediction is not None
            and prediction.route is route
            and prediction.measured
            and prediction.taken_s > 0
        ):
            self.metrics.prediction_error.labels(self.metrics.model_name, route.value).observe(
                seconds / prediction.taken_s
            )
