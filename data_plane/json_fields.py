"""JSON field types for messages from the network: numbers stay numbers, bools stay bools.

Pydantic's lax mode would accept ``true`` or ``"12"`` as an int; strict mode would refuse
``12.0``, which JSON Schema calls a valid integer. These types take exactly what the schema says.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator


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


JsonInt = Annotated[int, BeforeValidator(_json_int)]
JsonFloat = Annotated[float, BeforeValidator(_json_number)]
JsonBool = Annotated[bool, BeforeValidator(_json_bool)]
