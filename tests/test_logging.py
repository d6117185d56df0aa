"""The library's events reach the application's logging set-up, and nothing else: the
level of the standard ``asupervisor`` logger decides what is emitted, whatever the set-up."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests import forked

pytestmark = pytest.mark.slow

# An application that sets up logging one of the common ways (or not at all), then runs
# one short session for each level of the library's logger: not set (what it inherits
# from the root logger), WARNING, INFO and DEBUG. Each section of stdout starts "== LEVEL".
RUN = textwrap.dedent(
    """
    import json, logging, logging.config, os, sys
    import anyio, structlog, tensorflow as tf
    import asupervisor as asv

    mode, logdir = sys.argv[1], sys.argv[2]
    chain = [structlog.stdlib.add_logger_name, structlog.stdlib.add_log_level]
    if mode == "stdlib":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(name)s %(levelname)s %(message)s")
    elif mode == "structlog":  # structlog alone, printing JSON
        structlog.configure(
            processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
            logger_factory=structlog.PrintLoggerFactory(sys.stdout))
    elif mode == "structlog-filtering":  # ... with its own level
        structlog.configure(
            processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_factory=structlog.PrintLoggerFactory(sys.stdout))
    elif mode == "structlog-stdlib":  # structlog on top of the standard library's loggers
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        structlog.configure(
            processors=[structlog.stdlib.filter_by_level, *chain,
                        structlog.processors.JSONRenderer()],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger)
    elif mode == "structlog-formatter":  # the standard library's handlers render with structlog
        structlog.configure(
            processors=[*chain, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.JSONRenderer()],
            foreign_pre_chain=chain))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)

    # Every call that sets up logging, made from the library's own code, is recorded.
    # (TensorFlow's absl calls logging.basicConfig() at its first message when the root
    # logger has no handler: absl's doing, not the library's.)
    package = os.path.dirname(asv.__file__) + os.sep
    configured = []
    def recorded(owner, name):
        original = getattr(owner, name)
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                configured.append(f"{name} from {caller}")
            return original(*args, **kwargs)
        setattr(owner, name, call)
    for name in ("addHandler", "removeHandler", "setLevel", "addFilter"):
        recorded(logging.Logger, name)
    for name in ("basicConfig", "disable", "captureWarnings", "dictConfig", "fileConfig"):
        recorded(logging.config if name.endswith("Config") and name != "basicConfig"
                 else logging, name)
    for name in ("configure", "configure_once", "reset_defaults"):
        recorded(structlog, name)

    library = logging.getLogger("asupervisor")
    v = tf.Variable(0.0)

    async def main(logdir: str) -> None:
        sv = asv.Supervisor(logdir, checkpoint={"v": v}, save_model_secs=60,
                            save_summaries_secs=0.05, summary_fn=lambda: {"v": v})
        async with sv.session() as sess:
            for _ in range(20):
                await sess.run(v.assign_add, 1.0)
                await anyio.sleep(0.02)

    for level in ("unset", "WARNING", "INFO", "DEBUG"):
        library.setLevel(logging.NOTSET if level == "unset" else level)
        print("==", level, flush=True)
        print("==", level, file=sys.stderr, flush=True)
        anyio.run(main, f"{logdir}-{level}")
        sys.stdout.flush()
    library.setLevel(logging.NOTSET)
    print("== configured", json.dumps(configured), flush=True)
    """
)

MODES = ["none", "stdlib", "structlog", "structlog-filtering", "structlog-stdlib",
         "structlog-formatter"]  # fmt: skip
INFO, DEBUG = "session.started", "summary.written"  # an info event, and a debug one
# What each set-up shows, at each level of the library's logger: an unset level is what
# the root logger has (WARNING unless the application set one); a structlog filter of
# the application's own applies on top.
SHOWN = {
    "none": {"unset": (), "WARNING": (), "INFO": (), "DEBUG": ()},
    "stdlib": {"unset": (INFO,), "WARNING": (), "INFO": (INFO,), "DEBUG": (INFO, DEBUG)},
    "structlog": {"unset": (), "WARNING": (), "INFO": (INFO,), "DEBUG": (INFO, DEBUG)},
    "structlog-filtering": {"unset": (), "WARNING": (), "INFO": (INFO,), "DEBUG": (INFO,)},
    "structlog-stdlib": {"unset": (INFO,), "WARNING": (), "INFO": (INFO,), "DEBUG": (INFO, DEBUG)},
    "structlog-formatter": {
        "unset": (INFO,),
        "WARNING": (),
        "INFO": (INFO,),
        "DEBUG": (INFO, DEBUG),
    },
}


def sections_of(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("== "):
            name, _, rest = line[3:].partition(" ")
            current = sections.setdefault(name, [rest] if rest else [])
        else:
            current.append(line)
    return sections


def run(tmp_path: Path, mode: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The lines of stdout and of stderr by section ("unset", "WARNING", "INFO", "DEBUG";
    on stdout also "configured")."""
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
    return sections_of(done.stdout), sections_of(done.stderr)


def event_of(line: str, mode: str) -> str:
    if mode == "stdlib":  # "asupervisor INFO checkpoint.saved path=..."
        name, _, rest = line.partition(" ")
        return rest.split()[1] if name == "asupervisor" else f"(from {name})"
    if not line.startswith("{"):
        return f"(not rendered: {line})"  # TensorFlow's own, through a plain handler
    record = json.loads(line)  # a structlog renderer's JSON
    if record.get("logger", "asupervisor") != "asupervisor":
        return f"(from {record['logger']})"  # TensorFlow's own
    return str(record["event"])


@pytest.mark.parametrize("mode", MODES)
def test_the_library_loggers_level_decides_in_every_set_up(tmp_path: Path, mode: str) -> None:
    sections, stderr = run(tmp_path, mode)
    for level, expected in SHOWN[mode].items():
        events = {event_of(line, mode) for line in sections[level]}
        assert {INFO, DEBUG} & events == set(expected), (mode, level, sections[level][:5])
        if INFO in expected:  # the events' fields reach the application's output
            saved = next(line for line in sections[level] if "checkpoint.saved" in line)
            assert "model.ckpt-" in saved and "step" in saved, saved
    assert json.loads(sections["configured"][0]) == []  # the library set nothing up
    if mode == "stdlib":  # one line per event: the event, then its fields
        assert any(line.startswith("asupervisor INFO session.started step=0 ") for line in
                   sections["INFO"])  # fmt: skip
    if mode == "none":  # and on stderr, Python's last resort shows warnings only
        for level in ("unset", "WARNING"):
            shown = [line for line in stderr[level] if INFO in line or DEBUG in line]
            assert shown == [], (level, shown)


def test_every_event_the_library_emits_is_in_the_documented_table() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    emitted = set()
    for path in [*root.glob("asupervisor/**/*.py"), *root.glob("services/*.py")]:
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
