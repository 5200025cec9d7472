"""Value types of process settings. Each parses a flag's or an environment variable's text (or
takes a Python value) and refuses a bad one with a message that names the value, which
``ProcessSettings`` prefixes with the flag and the variable."""

from __future__ import annotations

import ipaddress
import json
import math
from typing import Annotated, Literal

from pydantic import BeforeValidator
from pydantic_settings import NoDecode

from epdserve.wire.offers import TRANSPORT_NAMES

DTYPES = ("bfloat16", "float16", "float32")
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _number(kind: type, value: object, what: str):
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not {what}")
    if isinstance(value, (int, float)) and kind is float:
        return float(value)
    if isinstance(value, int):
        return value
    try:
        return kind(str(value).strip())
    except ValueError:
        raise ValueError(f"{value!r} is not {what}") from None


def _port(lowest: int):
    def parse(value: object) -> int:
        number = _number(int, value, "a port number")
        if not lowest <= number <= 65535:
            raise ValueError(f"port {number} is not in {lowest}..65535")
        return number

    return parse


def _bounded(kind: type, above_zero: bool):
    what = "an integer" if kind is int else "a number"

    def parse(value: object):
        number = _number(kind, value, what)
        if not math.isfinite(number):
            raise ValueError(f"{value} is not finite")
        if above_zero and number <= 0:
            raise ValueError(f"{value} must be above 0")
        if number < 0:
            raise ValueError(f"{value} must be 0 or above")
        return number

    return parse


def _byte_size(above_zero: bool):
    def parse(value: object) -> int:
        """Bytes, optionally with a binary suffix: ``1073741824``, ``512M``, ``1G``, ``64K``."""
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value)
            body = text.strip().upper().removesuffix("B").removesuffix("I")
            suffix = body[-1:] if body[-1:] in _SIZE_SUFFIXES else ""
            try:
                number = int(float(body[: len(body) - len(suffix)]) * _SIZE_SUFFIXES[suffix])
            except (ValueError, OverflowError):
                raise ValueError(f"{text!r} is not a size (bytes, or with K, M, G, T)") from None
        if number < 0:
            raise ValueError(f"{value!r}: a size cannot be negative")
        if above_zero and number == 0:
            raise ValueError(f"{value} must be above 0")
        return number

    return parse


def _dtype(value: object) -> str:
    if value not in DTYPES:
        raise ValueError(f"{value!r} is not one of {', '.join(DTYPES)}")
    return value


def _processor_kwargs(value: object) -> dict:
    """A JSON object of keyword arguments for the checkpoint's image and video processors, as
    vLLM's ``--mm-processor-kwargs`` (e.g. ``{"max_pixels": 1003520}``); from text it is JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{value!r} is not JSON: {exc.msg}") from None
    if not isinstance(value, dict) or not all(
        isinstance(key, str) and key.isidentifier() for key in value
    ):
        raise ValueError(f"{value!r} is not a JSON object of keyword arguments")
    return dict(value)


def _transports(value: object) -> tuple[str, ...]:
    """A non-empty list of known transports, in order, without blanks or repeats; from text it is
    comma-separated."""
    parts = str(value).split(",") if isinstance(value, str) else list(value)
    names = tuple(dict.fromkeys(str(name).strip() for name in parts if str(name).strip()))
    unknown = [name for name in names if name not in TRANSPORT_NAMES]
    if unknown or not names:
        raise ValueError(
            f"{value!r}: {'' if names else 'no transport given: '}give one or more of "
            f"{', '.join(TRANSPORT_NAMES)} (comma-separated)"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    return names


def _advertised_host(value: object) -> str:
    """An address peers use to reach this process: never an unspecified one (``0.0.0.0``, ``::``),
    which names every interface to a listener and none to a peer."""
    host = str(value).strip()
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{value!r} is not a host name or address")
    try:
        unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a DNS name
        return host
    if unspecified:
        raise ValueError(
            f"{host} is an unspecified address, which peers cannot reach: give the address they "
            "use (the pod IP, a DNS name); the address to listen on is a setting of its own"
        )
    return host


Port = Annotated[int, BeforeValidator(_port(1))]
AnyPort = Annotated[int, BeforeValidator(_port(0))]  # 0: any free port, the one taken is logged
PositiveInt = Annotated[int, BeforeValidator(_bounded(int, above_zero=True))]
NonNegativeInt = Annotated[int, BeforeValidator(_bounded(int, above_zero=False))]
PositiveSeconds = Annotated[float, BeforeValidator(_bounded(float, above_zero=True))]
NonNegativeSeconds = Annotated[float, BeforeValidator(_bounded(float, above_zero=False))]
ByteSize = Annotated[int, BeforeValidator(_byte_size(above_zero=False))]
PositiveByteSize = Annotated[int, BeforeValidator(_byte_size(above_zero=True))]
Dtype = Annotated[str, BeforeValidator(_dtype)]
# NoDecode: the environment's value is the comma-separated text, not JSON
ProcessorKwargs = Annotated[dict, NoDecode, BeforeValidator(_processor_kwargs)]
AdvertisedHost = Annotated[str, BeforeValidator(_advertised_host)]
TransportNames = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_transports)]
# The vision tower's attention (vision.attention): one call per layer, transformers' loop,
# or the first on CUDA only.
VisionAttention = Literal["auto", "varlen", "reference"]
# Regional torch.compile of the tower (vision.compilation): on, off, or on where it runs
# (CUDA with Triton and a C compiler).
TowerCompile = Literal["auto", "on", "off"]
