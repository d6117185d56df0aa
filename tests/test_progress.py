"""The progress line: drawn on a terminal (a real pseudo-terminal here), never into a pipe."""

from __future__ import annotations

import io
import logging
import os
import pty
import select

import anyio
import pytest
import structlog

import asupervisor as asv
from asupervisor.services import ProgressService
from tests.conftest import Pair

pytestmark = pytest.mark.asyncio


def read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.05)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


async def test_the_progress_line_is_drawn_on_a_terminal(logdir: str, pair: Pair) -> None:
    master, slave = pty.openpty()
    terminal = os.fdopen(slave, "w")
    try:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"p": pair},
            save_model_secs=0.1,
            save_summaries_secs=0,
            handle_signals=False,
        )
        sv.add_service(ProgressService(0.05, stream=terminal, total_steps=100))
        async with sv.session() as sess:
            for _ in range(30):
                await sess.run(pair.step)
                await anyio.sleep(0.01)
        screen = read_all(master)
    finally:
        terminal.close()
        os.close(master)
    assert "\r" in screen and "\x1b[K" in screen
    last = screen.rstrip("\r\n").split("\r")[-1]
    assert last.startswith("step 30/100 | ")
    assert "steps/s" in last and "loss 30" in last and "checkpoint" in last and "s ago" in last
    assert screen.endswith("\n")


async def test_nothing_is_drawn_into_a_pipe_or_file() -> None:
    stream = io.StringIO()
    sv = asv.Supervisor(None, handle_signals=False)
    sv.add_service(ProgressService(0.02, stream=stream))
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(lambda: {"loss": 1.0})
            await anyio.sleep(0.02)
    assert stream.getvalue() == ""


async def test_a_log_line_never_lands_on_the_progress_line(logdir: str, pair: Pair) -> None:
    master, slave = pty.openpty()
    terminal = os.fdopen(slave, "w")
    handler = logging.StreamHandler(terminal)  # the application logs to the same terminal
    library = logging.getLogger("asupervisor")
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    chunks: list[str] = []
    try:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"p": pair},
            save_model_secs=0.1,  # checkpoint.saved lines while the line is drawn
            save_summaries_secs=0,
            handle_signals=False,
        )
        sv.add_service(ProgressService(0.02, stream=terminal, total_steps=100))
        structlog.reset_defaults()  # unconfigured (capture_logs elsewhere configures it)
        async with sv.session() as sess:
            for _ in range(40):
                await sess.run(pair.step)
                await anyio.sleep(0.01)
                chunks.append(read_all(master))
        chunks.append(read_all(master))
    finally:
        library.removeHandler(handler)
        library.setLevel(logging.NOTSET)
        terminal.close()
        os.close(master)
    screen = "".join(chunks).replace("\r\n", "\n")
    logged = [line for line in screen.split("\n") if "checkpoint.saved" in line]
    assert logged, screen[-2000:]
    drawn_over = [line for line in logged if "steps/s" in line]
    assert drawn_over, "no log line came while the progress line was drawn"
    for line in drawn_over:
        # The progress text was erased ("\r", then "erase to end of line") before the
        # log line was written: what is left on the terminal's line is the log line.
        assert "\r\x1b[Kcheckpoint.saved" in line, repr(line)
        assert line.split("\r")[-1].removeprefix("\x1b[K").startswith("checkpoint.saved")
