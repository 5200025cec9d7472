"""A chat completion request's images: found in the client's body, and the body rewritten for vLLM.

The client's body is OpenAI's: ``messages[i].content`` a string or a list of parts; an image is a
part ``{"type": "image_url", "image_url": {"url": ...}}``. Everything else in the body travels to
vLLM as the client wrote it, except what only the gateway may set: ``ec_transfer_params``,
``image_embeds`` parts and an item's ``uuid`` (an identifier names content; a client that chose
one could make vLLM's caches serve another image's embedding).
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MAX_MESSAGES = 1024
MAX_URL_CHARS = 64 << 20  # a data: URI of the largest image the gateway takes, with room to spare


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
class ImageRef:
    """One ``image_url`` part: where it sits, and its URL."""

    message: int
    part: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}].image_url"


def image_refs(request: ChatRequest) -> list[ImageRef]:
    """Every image part, in prompt order; ``ChatRequestError`` for what the gateway refuses."""
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
            if kind == "image_embeds":
                raise ChatRequestError(
                    "image_embeds parts are set by the gateway; send the image as image_url", where
                )
            if kind != "image_url":
                continue
            if "uuid" in part:
                raise ChatRequestError(
                    "an image's uuid is set by the gateway (its content hash)", f"{where}.uuid"
                )
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str) or not url:
                raise ChatRequestError("image_url needs a 'url' string", f"{where}.image_url")
            if len(url) > MAX_URL_CHARS:
                raise ChatRequestError(
                    f"image_url is longer than {MAX_URL_CHARS} characters", f"{where}.image_url"
                )
            refs.append(ImageRef(m, p, url))
    return refs


@dataclass(frozen=True)
class EncodedImage:
    """An image whose rows the encode workers deliver: the part vLLM gets names it by identifier."""

    identifier: str
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class InlineImage:
    """An image vLLM encodes itself (colocated): the part carries it as a ``data:`` URI."""

    url: str

    @classmethod
    def of(cls, ref: ImageRef, data: bytes, media_type: str) -> InlineImage:
        """The client's own data URI, or the fetched bytes as one (vLLM need not fetch again)."""
        if ref.url.startswith("data:"):
            return cls(ref.url)
        return cls(f"data:{media_type};base64,{base64.b64encode(data).decode()}")


def rewrite(
    body: dict,
    refs: list[ImageRef],
    images: list[EncodedImage | InlineImage],
    rooms: dict[str, dict] | None,
) -> dict:
    """The body for vLLM: each image part replaced by ``images[i]``'s part, and the rooms of the
    encoded ones in ``ec_transfer_params``. ``body`` is left as it was."""
    out = copy.copy(body)
    out["messages"] = [dict(message) for message in body["messages"]]
    for m in {ref.message for ref in refs}:
        out["messages"][m]["content"] = list(out["messages"][m]["content"])
    for ref, image in zip(refs, images, strict=True):
        if isinstance(image, EncodedImage):
            part = {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": list(image.grid_thw)},
                "uuid": image.identifier,
            }
        else:
            part = {"type": "image_url", "image_url": {"url": image.url}}
        out["messages"][ref.message]["content"][ref.part] = part
    if rooms:
        out["ec_transfer_params"] = {"rooms": rooms}
    return out
