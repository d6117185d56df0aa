"""The library's one logger.

asupervisor never configures logging or structlog: it emits structured events
named ``noun.verb`` with key=value fields, and the application decides where
they go (``structlog.configure`` or the stdlib ``logging`` bridge).
"""

from __future__ import annotations

import structlog

log = structlog.get_logger("asupervisor")
