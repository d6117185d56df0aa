"""A pause for the tests' services that swallow their cancellation (imported by the test
processes and by the scripts they run in children; anyio only)."""

from __future__ import annotations

import anyio


async def pause() -> None:
    """A swallowing service's loop goes round at once once the stop is asked (its wait
    returns) and once it is cancelled (every await raises again): it would spin a core
    for the whole grace, and beside a process's exit (its ``EXIT_SECS``). A pause no
    cancellation reaches keeps it a service that never ends, without the spin."""
    with anyio.CancelScope(shield=True):
        try:
            await anyio.sleep(0.05)
        except anyio.get_cancelled_exc_class():
            pass  # asyncio's own (a task's cancel(), which no shield holds): swallowed too
