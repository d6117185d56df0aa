"""The command lines ``asupervisor run`` and ``asupervisor health``, and the ledger and
heartbeat lines of ``asupervisor inspect``. None of them imports TensorFlow for a
local logdir: they start in a fraction of a second."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from typing import Any

from .._logdir import heartbeat as _heartbeat
from .._logdir.heartbeat import judge
from .._logdir.store import Store, is_object_store
from .._run.supervisor import DEFAULT_PRELOAD, RunConfig, run_command
from .text import shown

RUN_DESCRIPTION = """\
Run a training command and keep it running without a person: forward a graceful
stop, restart it after a failure (all workers together), kill it when its heartbeat
says it is stuck, and give up with a report when it fails again and again at the
same place.

What is restarted: a failure (exit status 1, a death by a signal such as SIGKILL from
the OOM killer) and a stuck run (124: the child's own watchdog, or a heartbeat past
--stuck-after). What is passed on and not restarted: done (0), preempted (42), failed
permanently (78: bad configuration or input, a checkpoint that does not fit the model,
a NaN loss; 126/127: the command cannot run) and interrupted (130).

The restart budget is refilled by progress: a failure after which the logdir holds a
newer checkpoint than when the attempt began costs nothing and restarts at once;
--max-failures failures in a row without one are a crash loop. Between those, the
restart waits --backoff seconds, doubling up to --max-backoff.

SIGTERM, SIGINT or SIGUSR1 (SLURM's requeue signal) to the supervisor sends
--stop-signal to every child, waits --grace seconds for its final checkpoint, then
kills what is left; a second SIGINT kills at once. Every child runs in a process group
of its own, killed whole when the child ends and when the supervisor exits; a child
also dies with the supervisor if the supervisor is SIGKILLed. The children get
ASUPERVISOR_HEARTBEAT (the file their session beats into) and ASUPERVISOR_ATTEMPT
(1, 2, ...) in their environment; with --workers N, TF_CONFIG too.
"""

RUN_EPILOG = """\
examples:
  asupervisor run --logdir runs/x -- python train.py --logdir runs/x
  nohup asupervisor run --logdir runs/x --standby -- python train.py --logdir runs/x \\
      > train.log 2>&1 &
  asupervisor run --workers 2 --logdir runs/mw -- python examples/multiworker.py \\
      --logdir runs/mw

exit status (the supervisor passes its children's on):
  0      done: the command finished its training
  42     preempted: a stop signal reached the supervisor (or the child); the final
         checkpoint is on disk: run the same command again to go on
  78     failed permanently: not retried (126/127: the command cannot run)
  1      failed, and the restart budget is spent (a crash loop)
  124    stuck, and the budget is spent; or a child did not stop within --grace
  128+N  the last failure of a crash loop was a death by signal N (137: SIGKILL)
  130    a second SIGINT: every child killed at once
  2      bad arguments
"""

HEALTH_EPILOG = """\
examples:
  asupervisor health runs/x --max-age 300          exit 0 alive, 1 stale
  asupervisor health /tmp/beat.json --max-age 60   a heartbeat file (ASUPERVISOR_HEARTBEAT)

  # a Kubernetes liveness probe on the training container:
  livenessProbe:
    exec: {command: [asupervisor, health, /runs/x, --max-age, "300"]}
    periodSeconds: 60

A run is stale when its heartbeat is older than --max-age (its event loop is blocked,
or the process is frozen or gone), or when one step (any work on the training thread)
has run longer than that. Before the first step has ended (restore, tracing) and while
the session stops (the final checkpoint), --startup-max-age applies instead. A session
that has ended is healthy (the process may do other work after it).

exit status: 0 alive (or the session has ended), 1 stale, 2 no heartbeat (not started
yet, or not an asupervisor logdir), an unreadable one, or bad arguments.
"""


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {text!r}")
    return value


def _signal(text: str) -> signal.Signals:
    name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
    found = signal.Signals.__members__.get(name)
    if found is None or found in (signal.SIGKILL, signal.SIGSTOP):
        raise argparse.ArgumentTypeError(f"{text!r} is not a signal that can ask for a stop")
    return found


def add_commands(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Add ``run`` and ``health`` to the ``asupervisor`` command line."""
    run = commands.add_parser(
        "run",
        help="run a training command: restart it on failures, kill it when it hangs",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=formatter,
        usage="asupervisor run [options] -- COMMAND [ARG ...]",
    )
    run.add_argument(
        "--logdir",
        help="the run's logdir: progress is its newest committed checkpoint (without it, "
        "what the chief's heartbeat says it committed)",
    )
    run.add_argument(
        "--workers",
        type=_count,
        default=1,
        help="start N workers of a multi-worker job on loopback ports (TF_CONFIG); when "
        "one fails, all stop and all restart together (default: 1)",
    )
    run.add_argument(
        "--max-failures",
        type=_count,
        default=3,
        metavar="K",
        help="K failures in a row without a newer checkpoint are a crash loop (default: 3)",
    )
    run.add_argument(
        "--backoff",
        type=_non_negative,
        default=1.0,
        metavar="SECS",
        help="the first wait before a restart without progress (default: 1)",
    )
    run.add_argument(
        "--max-backoff",
        type=_non_negative,
        default=60.0,
        metavar="SECS",
        help="the longest wait, doubling up to it (default: 60)",
    )
    run.add_argument(
        "--grace",
        type=_non_negative,
        default=120.0,
        metavar="SECS",
        help="after a stop signal, how long a child may take to save and exit before it is "
        "killed; more than the child's stop_grace_secs, less than the orchestrator's own "
        "grace (Kubernetes' terminationGracePeriodSeconds) (default: 120)",
    )
    run.add_argument(
        "--stop-signal",
        type=_signal,
        default=signal.SIGTERM,
        metavar="SIG",
        help="what the children get to stop gracefully (default: SIGTERM)",
    )
    run.add_argument(
        "--stuck-after",
        type=_positive,
        default=300.0,
        metavar="SECS",
        help="a child whose heartbeat is older, or whose step has run longer, is stuck: "
        "stopped, killed after 10 s, and restarted (default: 300)",
    )
    run.add_argument(
        "--startup-timeout",
        type=_positive,
        default=900.0,
        metavar="SECS",
        help="the same before the first step has ended (imports, restore, tracing) and "
        "during the final checkpoint (default: 900)",
    )
    run.add_argument(
        "--no-heartbeat",
        dest="heartbeat",
        action="store_false",
        help="do not watch heartbeats (for a command that runs no asupervisor session)",
    )
    run.add_argument(
        "--standby",
        action="store_true",
        help="keep a warm interpreter (TensorFlow imported) for each worker, which takes "
        "the next restart: about a second instead of several. Only for `python SCRIPT "
        "...` commands; it costs the memory of an interpreter with TensorFlow imported",
    )
    run.add_argument(
        "--preload",
        default=",".join(DEFAULT_PRELOAD),
        metavar="MODULES",
        help="what a standby imports, comma-separated (default: %(default)s)",
    )
    run.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the training command and its arguments",
    )
    run.set_defaults(handler=_run_main, parser=run)

    health = commands.add_parser(
        "health",
        help="exit 0 if a run's heartbeat is fresh, 1 if it is stale (a liveness probe)",
        description="Judge a running session from its heartbeat: the logdir's (written by "
        "the chief) or a heartbeat file (ASUPERVISOR_HEARTBEAT).",
        epilog=HEALTH_EPILOG,
        formatter_class=formatter,
    )
    health.add_argument("target", metavar="LOGDIR_OR_FILE")
    health.add_argument(
        "--max-age", type=_positive, default=300.0, metavar="SECS", help="(default: 300)"
    )
    health.add_argument(
        "--startup-max-age",
        type=_positive,
        default=None,
        metavar="SECS",
        help="(default: 3 x --max-age)",
    )
    health.add_argument("--json", action="store_true", help="print JSON")
    health.set_defaults(handler=_health_main, parser=health)


def _run_main(args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        args.parser.error("give the command to run after --")
    preload = tuple(m.strip() for m in args.preload.split(",") if m.strip())
    config = RunConfig(
        command=tuple(command),
        logdir=args.logdir,
        workers=args.workers,
        max_failures=args.max_failures,
        backoff_secs=args.backoff,
        max_backoff_secs=max(args.max_backoff, args.backoff),
        grace_secs=args.grace,
        stop_signal=args.stop_signal,
        stuck_after=args.stuck_after if args.heartbeat else None,
        startup_timeout=max(args.startup_timeout, args.stuck_after),
        standby=args.standby,
        preload=preload,
    )
    return run_command(config)


def _heartbeat_path(target: str) -> str:
    if is_object_store(target):
        return (
            target
            if target.endswith("/" + _heartbeat.NAME)
            else Store(target).path(_heartbeat.NAME)
        )
    return os.path.join(target, _heartbeat.NAME) if os.path.isdir(target) else target


def _health_main(args: argparse.Namespace) -> int:
    path = _heartbeat_path(args.target)
    try:
        beat = _heartbeat.read(path)
    except (OSError, ValueError) as exc:
        print(
            f"asupervisor health: unreadable heartbeat {shown(path)}: {shown(exc)}", file=sys.stderr
        )
        return 2
    if beat is None:
        print(
            f"asupervisor health: no heartbeat at {shown(path)} (not started yet, or not "
            "a logdir an asupervisor session runs in)",
            file=sys.stderr,
        )
        return 2
    startup = args.startup_max_age or 3 * args.max_age
    verdict = judge(beat, time.time(), args.max_age, startup)
    if args.json:
        print(
            json.dumps({"healthy": not verdict.stale, "why": verdict.why, "beat": beat.as_dict()})
        )
    else:
        state = "STALE" if verdict.stale else "healthy"
        print(f"{state}: {shown(verdict.why)} (pid {beat.pid} on {shown(beat.host)})")
    return 1 if verdict.stale else 0
