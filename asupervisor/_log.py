"""The library's one logger: structured events that go where the application says.

asupervisor never configures logging or structlog. Each event has a ``noun.verb``
name and key=value fields. The level of the standard library logger ``asupervisor``
decides which events are emitted, in every set-up (unset, it is the root logger's:
WARNING unless the application chose another). An event that passes it goes:

- through the application's structlog configuration, if it configured structlog
  (its processors and renderer format the event; with structlog on top of the
  standard library, through the ``asupervisor`` logger and its handlers);
- otherwise through the logger ``asupervisor``, as one line ``event key=value ...``
  with the event and its fields also on the record (``record.asupervisor_event``,
  ``record.asupervisor_fields``) for structured handlers. An application that
  configured nothing sees warnings and errors only (Python's last resort).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import structlog

_stdlib = logging.getLogger("asupervisor")


def _render(event: str, fields: dict[str, Any]) -> str:
    parts = [event]
    for key, value in fields.items():
        text = value if isinstance(value, str) and value and " " not in value else repr(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class EventLogger:
    """``log.info("checkpoint.saved", step=5)``; also ``debug``, ``warning``, ``error``.

    ``before_emit(callback)`` registers a callback run before each event that will be
    shown (a live progress line erases itself there, so no log line is appended to it).
    What the callback returns, if callable, is called once the event is written (the
    progress line holds its lock from its erasing to then, so that it is not drawn again
    between the two).
    """

    def __init__(self) -> None:
        self._before: list[Callable[[], Callable[[], None] | None]] = []

    def before_emit(self, callback: Callable[[], Callable[[], None] | None]) -> Callable[[], None]:
        """Run ``callback()`` before each event is emitted, and what it returns (if
        anything) after; returns a function that undoes it."""
        self._before.append(callback)

        def remove() -> None:
            if callback in self._before:
                self._before.remove(callback)

        return remove

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        # A log call must never break training or a stop: an output pipe closed
        # under a piped run (`make demo | tee log`, then Ctrl-C) makes it raise.
        try:
            if not _stdlib.isEnabledFor(level):  # the one level, whatever the set-up
                return
            after: list[Callable[[], None]] = []
            try:
                for callback in list(self._before):
                    done = callback()
                    if done is not None:
                        after.append(done)
                self._write(level, event, fields)
            finally:  # whatever happened: a lock taken is released
                for done in reversed(after):
                    done()
        except Exception:
            pass

    def _write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            method = logging.getLevelName(level).lower()
            getattr(structlog.get_logger("asupervisor"), method)(event, **fields)
            return
        exc_info = fields.pop("exc_info", None)
        _stdlib.log(
            level,
            "%s",
            _render(event, fields),
            exc_info=exc_info,
            extra={"asupervisor_event": event, "asupervisor_fields": fields},
        )

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)


log = EventLogger()
