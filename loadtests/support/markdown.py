"""Markdown tables, as the bench's reports print them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """The header row, its rule, then one line a row; cells are written as given."""
    lines = [_row(header), "|" + "---|" * len(header)]
    lines += [_row(cells) for cells in rows]
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
