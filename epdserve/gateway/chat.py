"""A chat completion request's images and videos: found in the client's body, and the body
rewritten for vLLM.

The client's body is OpenAI's: ``messages[i].content`` a string or a list of parts; an image is a
part ``{"type": "image_url", "image_url": {"url": ...}}``, a video (vLLM's extension) a part
``{"type": "video_url", "video_url": {"url": ...}}``. Everything else in the body travels to vLLM
as the client wrote it, except what only the gateway may set: ``ec_transfer_params``,
``image_embeds`` / ``video_embeds`` parts and an item's ``uuid`` (an identifier names content; a
client that chose one could make vLLM's caches serve another item's embedding).
"""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epdserve.gateway.errors import OpenAIError
from epdserve.wire.modality import BY_VLLM_NAME

MAX_MESSAGES = 1024
MAX_URL_CHARS = 128 << 20  # a data: URI of the largest item the gateway takes, with room to spare
KINDS = tuple(BY_VLLM_NAME)  # a part of type f"{kind}_url" carries one; f"{kind}_embeds" is ours


class ChatRequestError(ValueError):
    """The body is not a chat request the gateway can serve; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict] | None = None


class ChatRequest(BaseModel):
    """What the gateway reads of a chat completion body (the rest passes through)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=512)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False


@dataclass(frozen=True)
class MediaRef:
    """One ``image_url`` or ``video_url`` part: where it sits, what it is, and its URL."""

    message: int
    part: int
    url: str
    kind: str = "image"  # one of KINDS

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}].{self.kind}_url"


def media_refs(request: ChatRequest) -> list[MediaRef]:
    """Every image and video part, in prompt order; ``ChatRequestError`` for what the gateway
    refuses."""
    if request.model_extra and "ec_transfer_params" in request.model_extra:
        raise ChatRequestError(
            "ec_transfer_params is set by the gateway, not by clients", "ec_transfer_params"
        )
    refs = []
    for m, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            kind = part.get("type")
            if not isinstance(kind, str):
                raise ChatRequestError("a content part needs a string 'type'", f"{where}.type")
            media, _, form = kind.rpartition("_")
            if media not in KINDS:
                continue
            if form == "embeds":
                raise ChatRequestError(
                    f"{kind} parts are set by the gateway; send the {media} as {media}_url", where
                )
            if form != "url":
                continue
            if "uuid" in part:
                raise ChatRequestError(
                    f"a {media}'s uuid is set by the gateway (its content hash)", f"{where}.uuid"
                )
            value = part.get(kind)
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise ChatRequestError(f"{kind} needs a 'url' string", f"{where}.{kind}")
            if len(url) > MAX_URL_CHARS:
                raise ChatRequestError(
                    f"{kind} is longer than {MAX_URL_CHARS} characters", f"{where}.{kind}"
                )
            refs.append(MediaRef(m, p, url, media))
    return refs


@dataclass(frozen=True)
class EncodedMedia:
    """An item whose rows the encode workers deliver: the part vLLM gets names it by identifier
    and carries its patch grid (a video's also its seconds per temporal patch, where the model's
    positions take them, and each temporal patch's time, where its prompt states them)."""

    identifier: str
    grid_thw: tuple[int, int, int]
    kind: str = "image"
    seconds_per_grid_t: float | None = None
    patch_times: tuple[float, ...] | None = None

    def part(self) -> dict:
        embeds: dict = {f"{self.kind}_grid_thw": list(self.grid_thw)}
        if self.seconds_per_grid_t is not None:
            embeds["second_per_grid_ts"] = [self.seconds_per_grid_t]
        if self.patch_times is not None:
            embeds["timestamps"] = list(self.patch_times)
        return {
            "type": f"{self.kind}_embeds",
            f"{self.kind}_embeds": embeds,
            "uuid": self.identifier,
        }


@dataclass(frozen=True)
class InlineMedia:
    """An item vLLM encodes itself (colocated): the part carries it as a ``data:`` URI."""

    url: str
    kind: str = "image"

    @classmethod
    def of(cls, ref: MediaRef, data: bytes, media_type: str) -> InlineMedia:
        """The client's own data URI, or the fetched bytes as one (vLLM need not fetch again)."""
        if ref.url.startswith("data:"):
            return cls(ref.url, ref.kind)
        return cls(f"data:{media_type};base64,{base64.b64encode(data).decode()}", ref.kind)

    def part(self) -> dict:
        return {"type": f"{self.kind}_url", f"{self.kind}_url": {"url": self.url}}


@dataclass(frozen=True)
class CarriedMedia:
    """An item whose rows the encode workers deliver, for a model vLLM takes no request of grids
    alone for (``TowerFamily.grid_only_requests`` False): the part carries the item itself (as
    ``InlineMedia`` does: the bytes the gateway hashed, sized and sent to the worker) named by its
    identifier; vLLM's front end preprocesses it to place its rows, and the connector loads the
    worker's rows for that identifier (vLLM's tower is not run for it)."""

    identifier: str
    media: InlineMedia

    def part(self) -> dict:
        return {**self.media.part(), "uuid": self.identifier}


def rewrite(
    body: dict,
    refs: list[MediaRef],
    media: list[EncodedMedia | CarriedMedia | InlineMedia],
    rooms: dict[str, dict] | None,
) -> dict:
    """The body for vLLM: each image or video part replaced by ``media[i]``'s part, and the rooms
    of the encoded ones in ``ec_transfer_params``. ``body`` is left as it was."""
    out = copy.copy(body)
    out["messages"] = [dict(message) for message in body["messages"]]
    for m in {ref.message for ref in refs}:
        out["messages"][m]["content"] = list(out["messages"][m]["content"])
    for ref, item in zip(refs, media, strict=True):
        out["messages"][ref.message]["content"][ref.part] = item.part()
    if rooms:
        out["ec_transfer_params"] = {"rooms": rooms}
    return out


class BodyBudget:
    """The bytes of request bodies being received at once, bounded: requests are counted in
    ``--max-in-flight`` only once their body is in, so this bounds what bodies on their way in
    hold (a stalled upload holds what it sent, at most ``--body-timeout-s``)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.held = max_bytes, 0

    def take(self, nbytes: int) -> None:
        if self.held + nbytes > self.max_bytes:
            raise OpenAIError(
                503,
                f"the gateway holds {self.max_bytes} bytes of request bodies being received "
                "(--max-receiving-bytes); retry shortly",
                kind="overloaded",
                retry_after_s=1,
            )
        self.held += nbytes

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes


async def read_chat(
    request: Request, max_body_bytes: int, budget: BodyBudget
) -> tuple[dict, ChatRequest]:
    """The request's body (at most ``max_body_bytes``, within ``budget`` while it is received)
    as JSON and as a ``ChatRequest``; ``OpenAIError`` (400, 413, 503) otherwise."""
    data = bytearray()
    try:
        async for chunk in request.stream():
            budget.take(len(chunk))
            data += chunk
            if len(data) > max_body_bytes:
                raise OpenAIError(413, f"request body larger than {max_body_bytes} bytes")
    finally:
        budget.give_back(len(data))
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise OpenAIError(400, f"request body is not JSON: {exc}") from None
    except RecursionError:  # the parser's recursion: arrays or objects nested ~1,000 deep
        raise OpenAIError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return body, ChatRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise OpenAIError(400, f"{where}: {error['msg']}", param=where) from None
