"""Text for a terminal: what a file or a child's output names, shown safely."""

from __future__ import annotations


def shown(text: object) -> str:
    """``text`` with every control character escaped: a file named with a newline or
    an ANSI escape must not forge lines or colours on the terminal."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text)
    )


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover
