"""Text for a terminal: what a file or a child's output names, shown safely."""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Sequence


def shown(text: object) -> str:
    """``text`` with every control character escaped: a file named with a newline or
    an ANSI escape must not forge lines or colours on the terminal."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text)
    )


def cut(text: str, width: int) -> str:
    """``text``, or its first ``width`` columns ending in ``...`` when it is longer."""
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def fit(line: str, width: int) -> str:
    """A line cut to ``width`` columns (its end marked ``...``): tables put free text
    last, so what is cut is the end of a reason, a name, a metric."""
    return cut(line, width)


def wrapped(text: str, width: int, indent: str = "    ") -> list[str]:
    """A line of prose (a path, a reason) as lines of at most ``width`` columns, the
    later ones indented: nothing of it is cut."""
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def columns(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()
) -> list[str]:
    """A table's lines, each column as wide as its widest cell (no cell overflows into the
    next), two spaces between columns; the columns in ``right`` aligned right. Cells are
    shown as given: escape what a file or a child named (``shown``) first."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
