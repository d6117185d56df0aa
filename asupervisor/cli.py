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
from ._cli.inspect import TAIL, render
from ._cli.quiet import quiet_tensorflow
from ._cli.run import add_commands
from ._cli.text import shown
from ._logdir.report import inspect_logdir
from ._logdir.store import unreachable
from ._outcome import Outcome

EPILOG = """\
examples:
  asupervisor inspect runs/digits          the run for people: summary first, 100 columns
  asupervisor inspect runs/digits --all    every session, restart, attempt and commit
  asupervisor inspect runs/digits --json   everything, for scripts (jq, monitoring)

exit status: 0 when the logdir was read, 1 when it holds no checkpoints, no events
files and no ledger, 2 for a missing logdir or bad arguments, 69 when the logdir's object
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
        help="the run, its sessions, checkpoints, history and tags of a logdir",
        description="Show what a logdir holds: the run in a few lines (its step, goodput\n"
        "and heartbeat), its newest sessions and what each restart cost, every checkpoint\n"
        "on disk (step, time, size, whether it reads back whole), the newest commits of\n"
        "its history with the counts, every TensorBoard tag with its last value and step\n"
        "range, and the events files. Every line fits 100 columns.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    inspect.add_argument("logdir", metavar="LOGDIR", help="the Supervisor's logdir")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument(
        "--all",
        dest="every",
        action="store_true",
        help=f"every session, restart and commit (without it: the newest {TAIL} of each)",
    )
    inspect.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not read every checkpoint and events record back: faster, and no "
        "TensorFlow is imported for a local logdir",
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
    # Only verifying reads tensors (and an object store is read through TensorFlow):
    # `--no-verify` on a local logdir imports no TensorFlow at all.
    local = os.path.isdir(args.logdir) and os.listdir(args.logdir)
    if "://" in args.logdir or (args.verify and local):
        quiet_tensorflow()
    try:
        report = inspect_logdir(args.logdir, verify=args.verify)
    except Exception as exc:  # the kinds are told apart there
        return _inspect_failed(args.logdir, exc)
    # A ledger alone is a run too: one whose attempts never saved (a crash loop, a SLURM
    # job's failing group) is what a person most needs to read.
    if not (report.checkpoints or report.events_files or report.sessions or report.groups):
        print(
            f"asupervisor inspect: {shown(repr(args.logdir))} holds no checkpoints, no "
            "events files and no ledger (is it the Supervisor's logdir?)",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report, args.every))
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
