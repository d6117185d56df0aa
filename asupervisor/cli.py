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

from ._cli import evaluate as _evaluate_cli
from ._cli.run import add_commands, ledger_lines
from ._logdir.report import LogdirReport, inspect_logdir

EPILOG = """\
examples:
  asupervisor inspect runs/digits          a table for people
  asupervisor inspect runs/digits --json   the same, for scripts (jq, monitoring)

exit status: 0 when the logdir was read, 1 when it holds no checkpoints and no
events files, 2 for a missing logdir or bad arguments.
"""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def shown(text: object) -> str:
    """``text`` with every control character escaped: a file named with a newline or
    an ANSI escape must not forge lines or colours on the terminal."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text)
    )


def render(report: LogdirReport) -> str:
    lines = [f"logdir: {shown(report.logdir)}"]
    latest = shown(report.latest_checkpoint or "none")
    lines.append(f"latest checkpoint: {latest}  (step {report.latest_step})")
    lines.append("")
    lines.append(f"checkpoints ({len(report.checkpoints)}):")
    lines.append(f"  {'step':>10}  {'saved (UTC)':<25}  {'size':>10}  readable  metrics")
    for c in report.checkpoints:
        readable = "yes" if c.readable else f"NO  {shown(c.problem)}"
        metrics = " ".join(f"{shown(k)}={v:.6g}" for k, v in sorted(c.metrics.items()))
        if c.healthy is False:
            metrics = "NOT HEALTHY (loss not finite) " + metrics
        lines.append(
            f"  {c.step:>10}  {c.saved:<25}  {_size(c.bytes):>10}  {readable:<8}  {metrics}"
        )
    lines.append("")
    lines.append(f"tags ({len(report.tags)}):")
    lines.append(f"  {'tag':<28}  {'kind':<9}  {'last value':>12}  {'steps':<17}  points")
    for name, t in sorted(report.tags.items()):
        value = "" if t.last_value is None else f"{t.last_value:.6g}"
        steps = f"{t.first_step}..{t.last_step}"
        lines.append(
            f"  {shown(name):<28}  {shown(t.kind):<9}  {value:>12}  {steps:<17}  {t.points}"
        )
    lines.append("")
    lines.append(f"events files ({len(report.events_files)}):")
    for f in report.events_files:
        damage = f"  DAMAGED: {shown(f.damaged)}" if f.damaged else ""
        lines.append(f"  {shown(f.name)}  {_size(f.bytes)}  {f.events} events{damage}")
    lines += ["", *ledger_lines(report, shown)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asupervisor",
        description="Look into asupervisor training runs, and run them without a person.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
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


def _quiet_tensorflow() -> None:
    """Keep TensorFlow's start-up chatter off the terminal (the CLI's choice, not the library's)."""
    if "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    # absl prints some lines before TF_CPP_MIN_LOG_LEVEL applies, and a machine
    # without a GPU reports a failed cuInit when devices are first listed.
    os.dup2(devnull, 2)
    try:
        import tensorflow

        tensorflow.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "evaluate":
        return _evaluate_cli.main(args)
    handler = getattr(args, "handler", None)
    if handler is not None:  # run, health
        return int(handler(args))
    if "://" in args.logdir or (os.path.isdir(args.logdir) and os.listdir(args.logdir)):
        _quiet_tensorflow()
    try:
        report = inspect_logdir(args.logdir, verify=args.verify)
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"asupervisor inspect: error: {shown(exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # a directory that cannot be listed or read
        print(f"asupervisor inspect: error: {type(exc).__name__}: {shown(exc)}", file=sys.stderr)
        return 2
    if not report.checkpoints and not report.events_files:
        print(
            f"asupervisor inspect: {shown(repr(args.logdir))} holds no checkpoints and no "
            "events files (is it the Supervisor's logdir?)",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
