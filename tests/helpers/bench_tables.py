"""A bench table that only names the figures a module's rows add (no results): what a
bench test checks each of those figures got a value in a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FigureNames:
    """Stands in for bench.run's table: keeps each figure's name, nothing else."""

    def __init__(self, sizes: Any) -> None:
        self.sizes = sizes
        self.names: set[str] = set()

    def spread(self, where: str, field: str) -> None:
        return None

    def figure(self, figure: str, c: Any, b: Any, **_kw: Any) -> None:
        self.names.add(figure)


def figure_names(rows: Callable[[Any], None], sizes: Any) -> set[str]:
    """The names of the figures ``rows(table)`` adds at ``sizes``."""
    table = FigureNames(sizes)
    rows(table)
    return table.names
