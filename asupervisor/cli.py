"""The ``asupervisor`` command line: ``inspect LOGDIR``, ``run -- COMMAND``,
``health LOGDIR``, ``evaluate LOGDIR --script PATH`` (``_evaluate_cli``).

Fast to start: TensorFlow is imported only when a logdir has something to read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from . import __version__
from ._cli import evaluate as _evaluate_cli
from ._cli.inspect import render
from ._cli.quiet import quiet_tensorflow
from ._cli.run import add_commands
from ._cli.text import shown
from ._logdir.report import inspect_logdir
from ._logdir.store import unreachable
from ._outcome import Outcome

EPILOG = """\
examples:
  asupervisor inspect runs/digits          a table for people
  asupervisor inspect runs/digits --json   the same, for scripts (jq, monitoring)

exit status: 0 when the logdir was read, 1 when it holds no checkpoints and no
events files, 2 for a missing logdir or bad arguments, 69 when the logdir's object
store cannot be reached (no network, no credentials).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asupervisor",
        description="Look into asupervisor training runs, and run them without a person.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="checkpoints, the latest step, scalar tags and events files of a logdir",
        description="Show what a logdir holds: every checkpoint (step, time, size, whether "
        "it reads back whole), the latest step, every TensorBoard tag with its last value "
        "and step range, and the events files.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    inspect.add_argument("logdir", metavar="LOGDIR", help="the Supervisor's logdir")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not read every checkpoint back (faster for very large checkpoints)",
    )
    _evaluate_cli.add_parser(commands)
    add_commands(commands, argparse.RawDescriptionHelpFormatter)  # run, health
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "evaluate":
        return _evaluate_cli.main(args)
    handler = getattr(args, "handler", None)
    if handler is not None:  # run, health
        return int(handler(args))
    if "://" in args.logdir or (os.path.isdir(args.logdir) and os.listdir(args.logdir)):
        quiet_tensorflow()
    try:
        report = inspect_logdir(args.logdir, verify=args.verify)
    except Exception as exc:  # the kinds are told apart there
        return _inspect_failed(args.logdir, exc)
    if not report.checkpoints and not report.events_files:
        print(
            f"asupervisor inspect: {shown(repr(args.logdir))} holds no checkpoints and no "
            "events files (is it the Supervisor's logdir?)",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return 0


def _inspect_failed(logdir: str, error: Exception) -> int:
    """One line on stderr for a logdir ``inspect`` could not read, and its status: 2 for a
    missing or unreadable directory, 69 for an object store that cannot be reached; any
    other error is raised on (a bug: its traceback helps)."""
    if (instead := unreachable(logdir, error)) is not None:
        print(f"asupervisor inspect: error: {shown(instead)}", file=sys.stderr)
        return Outcome.UNREACHABLE.exit_status
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        print(f"asupervisor inspect: error: {shown(error)}", file=sys.stderr)
        return 2
    if isinstance(error, (OSError, ValueError)):  # a directory that cannot be listed or read
        name = type(error).__name__
        print(f"asupervisor inspect: error: {name}: {shown(error)}", file=sys.stderr)
        return 2
    raise error


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
