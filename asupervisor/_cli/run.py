"""The command lines ``asupervisor run`` and ``asupervisor health``, and the ledger and
heartbeat lines of ``asupervisor inspect``. None of them imports TensorFlow for a
local logdir: they start in a fraction of a second."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from .._logdir import heartbeat as _heartbeat
from .._logdir.heartbeat import judge
from .._logdir.store import Store, is_object_store
from .._run.group import Restarts, StatusMap
from .._run.local_tier import checked_local_dir, checked_save_secs
from .._run.slurm import SlurmError, srun_command, step_tasks
from .._run.supervisor import (
    DEFAULT_GRACE_SECS,
    DEFAULT_PRELOAD,
    RunConfig,
    files_needed,
    make_room_for_files,
    run_command,
)
from .text import shown

RUN_DESCRIPTION = """\
Run a training command and keep it running without a person: forward a graceful
stop, restart it after a failure (all workers together), kill it when it hangs, and
give up with a report when it fails again and again without going forward.

What is restarted: a failure (exit status 1, a death by a signal such as SIGKILL from
the OOM killer), a logdir's object store that could not be reached (69: an outage
passes) and a stuck run (124: the child's own watchdog, or a heartbeat past
--stuck-after). What is passed on and not restarted: done (0), preempted (42), failed
permanently (78: bad configuration or input, a checkpoint that does not fit the model,
a NaN loss, a logdir another live run holds; 126/127: the command cannot run) and
interrupted (130).

The restart budget is refilled by this run's progress: a failure of an attempt that
committed a checkpoint (as the logdir's history records it with this run and attempt,
read once the attempt's processes ended, or as its session said first on its channel; a
restore is not one, and what another process writes into the logdir never counts) costs
nothing and restarts at once; --max-failures failures in a row without one are a crash
loop. Between those, the restart waits --backoff seconds, doubling up to --max-backoff.

Liveness: each process gets a pipe to the supervisor (ASUPERVISOR_CHANNEL) on which
its session reports its heartbeat (also with heartbeat_secs=0: every 2 s), its
commits, and the writes it could not make elsewhere (reported, never a reason to
kill). A child whose heartbeat stops, or whose training step runs longer than
--stuck-after, is stuck: the stop signal, SIGKILL 10 s later, and a restart. Other work
on the training thread (a save, a sess.call, an epoch's end, a rollback's restore), and
all of it before the first step has ended and during the final checkpoint, is bounded
by --startup-timeout instead. A process that still runs --stuck-after after its session ended is
stopped the same way, and its end is passed on with its session's status (a done run
stays done); one that dies of a signal after its session ended preempted (its final
checkpoint committed), or of the run's stop after its session ended done, is passed on
preempted: nothing is lost, and a restart runs what followed the session.

A job across hosts: when the one child is one worker of a larger job that others
start (TF_CONFIG names more than one task, or SLURM_STEP_NUM_TASKS > 1), a worker
restarted alone could not rejoin its group; then a failure or a hang ends the run at
once with the child's status, for the engine (SLURM, a JobSet, a TFJob) to restart the
job as a whole (--restarts).

SIGTERM, SIGINT or SIGUSR1 (SLURM's requeue signal) to the supervisor sends
--stop-signal to every child, waits --grace seconds for its final checkpoint, then
kills what is left; a second SIGINT kills at once. A child that dies of that signal
before its session began (still importing) was preempted: nothing trained, nothing
lost (with --no-heartbeat nobody knows: its status is passed on). Every child runs
in a process group of its own, killed whole when the child ends and when the
supervisor exits; a child also dies with the supervisor if the supervisor is
SIGKILLed. The children get ASUPERVISOR_CHANNEL, ASUPERVISOR_ATTEMPT
(1, 2, ...) and ASUPERVISOR_RUN (one id per run) in their environment; with
--workers N, TF_CONFIG too.

Two tiers of checkpoints (--local-dir DIR): every child's session saves to DIR, a
directory on this host (local SSD, or /dev/shm for the fastest), every few seconds, and
a mirror behind the training copies each of those saves to the logdir (gs://... or any
path). A restart on this host restores from DIR; on a new host, from the logdir. A kill
loses at most the local interval; a host that goes away loses what the mirror had not
copied yet ("steps at risk"). The children get ASUPERVISOR_LOCAL_DIR (and
ASUPERVISOR_LOCAL_SAVE_SECS), read by every Supervisor given no local_tier of its own.
"""

RUN_EPILOG = """\
examples:
  asupervisor run --logdir runs/x -- python train.py --logdir runs/x
  nohup asupervisor run --logdir runs/x --standby -- python train.py --logdir runs/x \\
      > train.log 2>&1 &
  asupervisor run --workers 2 --logdir runs/mw -- python examples/multiworker.py \\
      --logdir runs/mw

--grace and the session's stop_grace_secs: a stop gives the child's session
stop_grace_secs (120 by default) for the work in flight and its final checkpoint;
--grace must be more than that plus the few seconds a process takes to exit (the
default, 150, is), and the orchestrator's own grace (Kubernetes'
terminationGracePeriodSeconds) more than --grace. The supervisor says
run.grace_too_short when a child's stop_grace_secs does not fit.

exit status (the supervisor passes its children's on):
  0      done: the command finished its training
  42     preempted: a stop signal reached the supervisor (or the child) and the final
         checkpoint is on disk, or the child was still starting (nothing trained):
         run the same command again to go on
  78     failed permanently: not retried (126/127: the command cannot run)
  1      failed, and the restart budget is spent (a crash loop); or a child could
         not be started at all
  69     the logdir's object store could not be reached, and the budget is spent
  124    stuck, and the budget is spent
  75     a worker of a multi-worker job lost a peer (another worker, or its host, is
         gone), and the budget is spent
  128+N  the last failure of a crash loop was a death by signal N (137: SIGKILL), or
         a child did not exit within --grace of a stop and was killed (137)
  130    a second SIGINT: every child killed at once
  2      bad arguments (and a --workers count the open-file limit cannot hold)
  with --restarts engine (a job across hosts), a failure (1, 128+N), a lost peer
  (75) or a hang (124) is passed on at once; --exit-status-map shows any of these as another number
"""

HEALTH_EPILOG = """\
examples:
  asupervisor health runs/x --max-age 300          exit 0 alive, 1 stale
  asupervisor health /tmp/beat.json --max-age 60   a heartbeat file (ASUPERVISOR_HEARTBEAT)

  # a Kubernetes liveness probe on the training container: restart only when stale
  livenessProbe:
    exec: {command: [sh, -c, "asupervisor health /runs/x --max-age 300; test $? -ne 1"]}
    periodSeconds: 60
    timeoutSeconds: 30

A run is stale when its heartbeat is older than --max-age (its event loop is blocked,
or the process is frozen or gone), or when one training step has run longer than that.
Other work on the training thread (a save, a sess.call, an epoch's end, a rollback's
restore), and all of it before the first step has ended (restore, tracing) and while
the session stops (the final checkpoint), is bounded by --startup-max-age instead. A
session that has ended is healthy (the process may do other work after it).

exit status:
  0  alive, or the session has ended
  1  stale
  2  no heartbeat (not started yet, or not an asupervisor logdir), or bad arguments
  3  cannot tell: the heartbeat could not be read (storage out of reach or slower than
     --timeout, no permission, a damaged file). Not "stale": a probe that restarts on
     any failure restarts a healthy run on a storage hiccup
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


def _restarts(text: str) -> Restarts:
    try:
        return Restarts(text)
    except ValueError:
        names = ", ".join(r.value for r in Restarts)
        raise argparse.ArgumentTypeError(f"must be one of {names}, not {text!r}") from None


def _status_map(text: str) -> StatusMap:
    try:
        return StatusMap.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        help="the run's logdir, named in the crash-loop report with its newest checkpoint "
        "(progress is what this run's children commit, with or without it); a member of "
        "a job across hosts records its end there, for the chief's to fold into the ledger",
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
        default=DEFAULT_GRACE_SECS,
        metavar="SECS",
        help="after a stop signal, how long a child may take to save and exit before it is "
        "killed; more than the child's stop_grace_secs plus its exit (below), less than "
        "the orchestrator's own grace (Kubernetes' terminationGracePeriodSeconds) "
        "(default: %(default)g)",
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
        help="a child whose heartbeat is older, or whose training step has run longer, is "
        "stuck: "
        "stopped, killed after 10 s, and restarted; a process that still runs this long "
        "after its session ended is stopped, its session's status passed on (default: 300)",
    )
    run.add_argument(
        "--startup-timeout",
        type=_positive,
        default=900.0,
        metavar="SECS",
        help="the same for other work on the training thread (a save, a sess.call, an "
        "epoch's end, a rollback's restore), before the first step has ended (imports, "
        "restore, tracing) and during the final checkpoint (default: 900)",
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
        help="import TensorFlow once per run, in a warm interpreter that forks every start "
        "(the first, each restart, every worker): a restart takes under a second instead "
        "of several, and nothing imports beside the training. Only for `python SCRIPT ...` "
        "commands on Linux; it costs the memory of one interpreter with TensorFlow imported",
    )
    run.add_argument(
        "--preload",
        default=",".join(DEFAULT_PRELOAD),
        metavar="MODULES",
        help="what a standby imports, comma-separated (default: %(default)s)",
    )
    run.add_argument(
        "--restarts",
        type=_restarts,
        default=Restarts.AUTO,
        metavar="{auto,here,engine}",
        help="who restarts a worker that failed or hung: 'here' (this run), or 'engine' "
        "(this run's one child is one worker of a job across hosts: restarted alone it "
        "could not rejoin its group, so the run exits at once with the child's status, for "
        "SLURM, a JobSet or a TFJob to restart the job as a whole); 'auto' is 'engine' when "
        "TF_CONFIG names more than one task or SLURM_STEP_NUM_TASKS > 1 (one task of a SLURM "
        "step of several), else 'here' (default: auto)",
    )
    run.add_argument(
        "--slurm",
        action="store_true",
        help="in a SLURM batch script: run the command as one step of one task per node "
        "(srun --kill-on-bad-exit=1, each task an `asupervisor run --restarts engine` "
        "watching its worker, its TF_CONFIG built from SLURM's environment) and start the "
        "step again inside the allocation when it fails, with this run's budget; progress "
        "is read from the history, so --logdir is required",
    )
    run.add_argument(
        "--requeue",
        action="store_true",
        help="with --slurm: when the run ends preempted (a notice, the time limit's "
        "warning: every worker's final checkpoint saved), requeue the batch job "
        "(scontrol requeue) to resume from it; for a cluster whose slurm.conf has no "
        "RequeueExit=42 (the job must be requeueable: sbatch --requeue)",
    )
    run.add_argument(
        "--local-dir",
        metavar="DIR",
        help="turn on the local tier of checkpoints for every child (every worker, every "
        "restart, every task of --slurm): its sessions save to DIR on this host every "
        "--local-save-secs, and mirror each save to their logdir behind the training; a "
        "directory of its own, apart from the logdir (default: off)",
    )
    run.add_argument(
        "--local-save-secs",
        metavar="SECS",
        help="with --local-dir: seconds between two local saves (default: the session's own, 10)",
    )
    run.add_argument(
        "--exit-status-map",
        type=_status_map,
        default=StatusMap(),
        metavar="MAP",
        help="the run's exit status as an engine that retries only some is told it: "
        "NAME=STATUS,... with NAME one of done, preempted, failed, permanent, stuck, "
        "interrupted, unreachable, lost-peer, or 'tfjob' (Kubeflow's TFJob retries only 130, "
        "137, 138 and 143: preempted=143,stuck=138,lost-peer=137,unreachable=137)",
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
        help="exit 0 if a run's heartbeat is fresh, 1 if it is stale, 3 if it cannot tell "
        "(a liveness probe)",
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
        help="the same for other work on the training thread (a save, a sess.call, an "
        "epoch's end, a rollback's restore), before the first step has ended and while "
        "the session stops (default: 3 x --max-age)",
    )
    health.add_argument(
        "--timeout",
        type=_positive,
        default=10.0,
        metavar="SECS",
        help="how long reading the heartbeat may take before the answer is 'cannot tell' "
        "(3) (default: 10)",
    )
    health.add_argument("--json", action="store_true", help="print JSON")
    health.set_defaults(handler=_health_main, parser=health)


def _run_main(args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return _error("run", "give the command to run after -- (asupervisor run [options] "
                      "-- COMMAND [ARG ...])", 2)  # fmt: skip
    found = shutil.which(command[0])
    if found is None:
        exists = os.path.exists(command[0]) and os.sep in command[0]
        why = "is not executable" if exists else "is not found (PATH)"
        return _error(
            "run", f"cannot run {shown(repr(command[0]))}: it {why}", 126 if exists else 127
        )
    try:
        local_dir, local_save_secs = _local_tier(args)
    except ValueError as exc:
        return _error("run", str(exc), 2)
    too_many = make_room_for_files(files_needed(args.workers, args.standby))
    if too_many is not None:
        return _error("run", f"--workers {args.workers}{' --standby' if args.standby else ''} "
                      f"{too_many}: raise it, or start fewer workers", 2)  # fmt: skip
    preload = tuple(m.strip() for m in args.preload.split(",") if m.strip())
    if args.requeue and not args.slurm:
        return _error("run", "--requeue requeues a SLURM batch job: it goes with --slurm", 2)
    if args.slurm:
        return _run_slurm(args, command, preload, _local_tier_options(local_dir, local_save_secs))
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
        restarts=args.restarts,
        status_map=args.exit_status_map,
        local_dir=local_dir,
        local_save_secs=local_save_secs,
    )
    return run_command(config)


def _local_tier(args: argparse.Namespace) -> tuple[str | None, float | None]:
    """``--local-dir`` and ``--local-save-secs``, checked before anything starts;
    ``ValueError`` with the one line to say, naming the flag."""
    save_secs = None
    if args.local_save_secs is not None:
        if args.local_dir is None:
            raise ValueError("--local-save-secs needs --local-dir (the local tier is off)")
        try:
            save_secs = checked_save_secs(args.local_save_secs)
        except ValueError as exc:
            raise ValueError(f"--local-save-secs {exc}") from None
    if args.local_dir is None:
        return None, None
    try:
        return checked_local_dir(args.local_dir, args.logdir), save_secs
    except ValueError as exc:
        raise ValueError(f"--local-dir {exc}") from None


# What the outer run of --slurm adds to its tasks' grace: srun's own forwarding and ending.
SLURM_GRACE_MARGIN_SECS = 15.0


def _run_slurm(
    args: argparse.Namespace, command: list[str], preload: tuple[str, ...], local: list[str]
) -> int:
    """``--slurm``: the outer run. Its child is the step (srun); liveness is each task's
    own run's to watch (a beat does not cross hosts), progress is the history's."""
    if not args.logdir:
        return _error("run", "--slurm needs --logdir: the step's progress is read from the "
                      "run's history", 2)  # fmt: skip
    if args.workers != 1:
        return _error("run", "--slurm starts one worker per task: --workers does not apply", 2)
    member = [
        "--grace", repr(args.grace), "--stop-signal", args.stop_signal.name,
        "--stuck-after", repr(args.stuck_after),
        "--startup-timeout", repr(max(args.startup_timeout, args.stuck_after)),
        "--preload", ",".join(preload), "--logdir", args.logdir,
        *([] if args.heartbeat else ["--no-heartbeat"]),
        *(["--standby"] if args.standby else []),
        *local,
    ]  # fmt: skip
    try:
        step = srun_command(command, os.environ, member, sys.executable)
    except SlurmError as exc:
        return _error("run", f"--slurm: {exc}", 2)
    config = RunConfig(
        command=tuple(step),
        logdir=args.logdir,
        max_failures=args.max_failures,
        backoff_secs=args.backoff,
        max_backoff_secs=max(args.max_backoff, args.backoff),
        grace_secs=args.grace + SLURM_GRACE_MARGIN_SECS,
        stop_signal=signal.SIGTERM,  # the step's process passes it on as scancel --signal
        stuck_after=None,
        restarts=Restarts.HERE,
        status_map=args.exit_status_map,
        step_tasks=step_tasks(os.environ),
        requeue_job=os.environ.get("SLURM_JOB_ID") if args.requeue else None,
    )
    return run_command(config)


def _local_tier_options(local_dir: str | None, save_secs: float | None) -> list[str]:
    """``--local-dir`` and ``--local-save-secs`` for each task of a ``--slurm`` step: each
    node's own run checks them again (its own disk) and gives them to its worker."""
    options = [] if local_dir is None else ["--local-dir", local_dir]
    return options + ([] if save_secs is None else ["--local-save-secs", repr(save_secs)])


def _error(command: str, message: str, status: int) -> int:
    """A command-line error: one line."""
    print(f"asupervisor {command}: error: {message}", file=sys.stderr)
    return status


def _heartbeat_path(target: str) -> str:
    if is_object_store(target):
        return (
            target
            if target.endswith("/" + _heartbeat.NAME)
            else Store(target).path(_heartbeat.NAME)
        )
    target = _heartbeat.local_path(target)  # {host}: this host's file (ASUPERVISOR_HEARTBEAT)
    return os.path.join(target, _heartbeat.NAME) if os.path.isdir(target) else target


CANNOT_TELL = 3  # health: the heartbeat could not be read (not "stale")


def _health_main(args: argparse.Namespace) -> int:
    path = _heartbeat_path(args.target)
    try:
        beat = _read_within(path, args.timeout)
    except TimeoutError:
        return _error("health", f"cannot tell: reading {shown(path)} took longer than "
                      f"{args.timeout:g} s (--timeout)", CANNOT_TELL)  # fmt: skip
    except Exception as exc:  # OSError, a damaged beat, an object store's error
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return _error("health", f"cannot tell: {shown(path)}: {type(exc).__name__}: "
                      f"{shown(detail)}"[:400], CANNOT_TELL)  # fmt: skip
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


def _read_within(path: str, timeout: float) -> _heartbeat.Beat | None:
    """The beat at ``path``, read in a thread given ``timeout`` seconds (an object store
    out of reach retries for minutes); ``TimeoutError`` past it."""
    result: list[Any] = []

    def read() -> None:
        try:
            result.append((True, _heartbeat.read(path)))
        except BaseException as exc:
            result.append((False, exc))

    reader = threading.Thread(target=read, name="asupervisor-health-read", daemon=True)
    reader.start()
    reader.join(timeout)
    if not result:
        raise TimeoutError(path)
    ok, value = result[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
