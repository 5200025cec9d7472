"""JSON field types for messages from the network: numbers stay numbers, bools stay bools.

Pydantic's lax mode would accept ``true`` or ``"12"`` as an int; strict mode would refuse
``12.0``, which JSON Schema calls a valid integer. These types take exactly what the schema says; their constraints sit inside the validator so that
they show in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field


def _json_int(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


def _json_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    return float(value)


def _json_bool(value):
    if not isinstance(value, bool):
        raise ValueError("must be a boolean")
    return value


def json_int(**constraints):
    """An int field with ``Field`` constraints (ge, le, ...) that also appear in the JSON schema."""
    return Annotated[int, Field(**constraints), BeforeValidator(_json_int)]


def json_float(**constraints):
    return Annotated[float, Field(**constraints), BeforeValidator(_json_number)]


JsonInt = json_int()
JsonBool = Annotated[bool, BeforeValidator(_json_bool)]
