"""Hook and RunContext: code that runs on the training thread around every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._session.managed import ManagedSession
    from .._supervisor import Supervisor


class Hook:
    """Base class with no-op methods; every method runs on the training thread."""

    def begin(self, supervisor: Supervisor) -> None:
        """Once per session, before anything is restored."""

    def after_create_session(self, session: ManagedSession) -> None:
        """Once per session, after restore-or-init; ``session.global_step`` is known."""

    def before_run(self, ctx: RunContext) -> None:
        """Before each step."""

    def after_run(self, ctx: RunContext, result: Any) -> None:
        """After each successful step; ``session.global_step`` is already advanced."""

    def after_save(self, session: ManagedSession, step: int, path: str) -> bool | None:
        """After each checkpoint; returning ``True`` requests a stop."""
        return None

    def end(self, session: ManagedSession) -> None:
        """Once, at the end of a session that stopped cleanly (before the final save)."""


@dataclass
class RunContext:
    """What a hook knows about the step being run."""

    step: int
    """The global step before this run."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    session: ManagedSession = field(repr=False)

    def request_stop(self) -> None:
        """Ask the session to stop after this step."""
        self.session.request_stop()
