"""The library's events reach the application's logging set-up, and nothing else."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests import forked

pytestmark = pytest.mark.slow

RUN = textwrap.dedent(
    """
    import logging, sys
    import anyio, structlog, tensorflow as tf
    import asupervisor as asv

    mode, logdir = sys.argv[1], sys.argv[2]
    if mode == "stdlib":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(name)s %(levelname)s %(message)s")
    elif mode == "structlog":
        structlog.configure(processors=[structlog.processors.JSONRenderer()],
                            logger_factory=structlog.PrintLoggerFactory(sys.stdout))
    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, save_model_secs=60,
                            save_summaries_secs=0.05, summary_fn=lambda: {"v": v})
        async with sv.session() as sess:
            for _ in range(20):
                await sess.run(v.assign_add, 1.0)
                await anyio.sleep(0.02)

    anyio.run(main)
    """
)


def run(tmp_path: Path, mode: str) -> forked.CompletedProcess[str]:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    done = forked.run(
        [sys.executable, str(script), mode, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert done.returncode == 0, done.stderr
    return done


def test_an_unconfigured_application_sees_no_debug_or_info_lines(tmp_path: Path) -> None:
    done = run(tmp_path, "none")
    assert done.stdout == ""
    for event in ("summary.written", "session.started", "checkpoint.saved", "session.stopped"):
        assert event not in done.stderr


def test_stdlib_logging_at_info_shows_the_events(tmp_path: Path) -> None:
    lines = run(tmp_path, "stdlib").stdout.splitlines()
    assert any(line.startswith("asupervisor INFO session.started step=0") for line in lines)
    assert any(line.startswith("asupervisor INFO checkpoint.saved ") for line in lines)
    assert any(line.startswith("asupervisor INFO session.stopped ") for line in lines)
    assert not any("summary.written" in line for line in lines)  # debug, below INFO


def test_a_structlog_configuration_renders_the_events(tmp_path: Path) -> None:
    events = [json.loads(line) for line in run(tmp_path, "structlog").stdout.splitlines()]
    names = [e["event"] for e in events]
    assert "session.started" in names and "summary.written" in names
    saved = next(e for e in events if e["event"] == "checkpoint.saved")
    assert saved["step"] in (0, 20) and saved["path"].endswith(f"model.ckpt-{saved['step']}")


def test_every_event_the_library_emits_is_in_the_documented_table() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    emitted = set()
    for path in root.glob("asupervisor/**/*.py"):
        emitted |= set(
            re.findall(
                r'(?:log|logger)\.(?:debug|info|warning|error|exception)\(\s*"([a-z_]+\.[a-z_]+)"',
                path.read_text(),
            )
        )
    table = [line.split("|")[1] for line in (root / "docs/API.md").read_text().splitlines()
             if line.startswith("| `")]  # fmt: skip
    documented = {name for cell in table for name in re.findall(r"`([a-z_]+\.[a-z_]+)`", cell)}
    assert emitted, "no events found: the pattern is wrong"
    assert sorted(emitted - documented) == []
