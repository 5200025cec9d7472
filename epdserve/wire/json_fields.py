"""JSON field types for messages from the network: numbers stay numbers, bools stay bools.

Pydantic's lax mode would accept ``true`` or ``"12"`` as an int; strict mode would refuse
``12.0``, which JSON Schema calls a valid integer. These types take exactly what the schema says,
and they validate in pydantic-core, with no Python call per field (a batch of rooms has many
int fields, parsed on every handshake call's path). Their constraints show in the JSON schema.
"""

from __future__ import annotations

import operator
from typing import Annotated

from pydantic import AfterValidator, Field, Strict, WithJsonSchema

_SCHEMA_KEYS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
}
_BOUNDS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def _whole_number(constraints: dict):
    """``2.0`` -> ``2``, bounds checked on the int (a float compare would round near 2**63)."""

    def convert(value: float) -> int:
        if not value.is_integer():
            raise ValueError("must be an integer")
        number = int(value)
        for key, bound in constraints.items():
            compare, symbol = _BOUNDS[key]
            if not compare(number, bound):
                raise ValueError(f"must be {symbol} {bound}")
        return number

    return AfterValidator(convert)


def json_int(**constraints):
    """An int field with ``Field`` constraints (ge, le, ...): a JSON integer, or a number with no
    fraction (``2.0``); never a bool or a string. The int branch is the fast one."""
    schema = {"type": "integer", **{_SCHEMA_KEYS[key]: value for key, value in constraints.items()}}
    whole_number = Annotated[float, Strict(), _whole_number(constraints)]
    return Annotated[
        Annotated[int, Strict(), Field(**constraints)] | whole_number, WithJsonSchema(schema)
    ]


def json_float(**constraints):
    """A number field (int or float in JSON, never a bool or a string)."""
    return Annotated[float, Strict(), Field(**constraints)]


JsonBool = Annotated[bool, Strict()]
