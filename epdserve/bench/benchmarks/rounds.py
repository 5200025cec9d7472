"""Interleaved rounds, as every benchmark here runs them: the configurations in order, then
reversed, round after round, so a drift of the machine's pace weighs on each alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def in_round(configs: Sequence[T], round_index: int) -> Sequence[T]:
    """``configs`` in the order round ``round_index`` runs them."""
    return configs if round_index % 2 == 0 else configs[::-1]
