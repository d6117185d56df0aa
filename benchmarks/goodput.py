"""Goodput under faults, with no person in the loop: `asupervisor run` + `sess.train`
against a shell `until` loop around a hand-written CheckpointManager loop and around
Keras `fit` + `BackupAndRestore`.

    python benchmarks/goodput.py                       # about an hour here
    python benchmarks/goodput.py --steps 4000           # a smoke run (faults too close)
    python benchmarks/goodput.py --slurm --steps 3000   # two workers on two SLURM nodes
    python benchmarks/goodput.py --store gcs --local-tier   # two tiers against one, on gs://

Each system trains the same model (784-512-512-10, Adam, batch 128) until its optimizer
has taken ``--steps`` steps, saving every ``--save-steps``, once without faults and once
under one fault schedule, the same for all (seeded times, drawn within the fault-free
run's duration):

- SIGKILL of the training process at three moments (a crash, the OOM killer);
- one exception raised by a step (SIGUSR2 to the trainer: its next step raises);
- one hang (SIGRTMIN+1: its next step sleeps forever);
- one preemption: SIGTERM to the whole process group of the top-level command (a
  node going away), SIGKILL after a grace of 30 s, and the command started again at
  once (what a Kubernetes Job or SLURM's requeue does).

Nothing else acts: the restarts are the top-level command's own (``asupervisor run``,
or ``until python trainer.py; do sleep 1; done``).

**Where the checkpoints go** (``--store``): a local directory, or ``gcs``: a logdir on
``gs://``, TensorFlow's own GCS client talking the real protocol to fake-gcs-server on
127.0.0.1 (``tests/gcs_fixture.py``: a real bucket is only slower). ``--local-tier``
compares, on that store, ``asupervisor run`` as it is (``asv``: a save every
``--save-steps``, each one to the store) with the same run given ``--local-dir``
(``asv-local``: a save to a directory of the host every ``--local-save-secs``, mirrored
to the store behind the training). A preemption takes the host away: the local tier's
directory is removed before the command starts again (a new node), so that run restores
from the store what the mirror copied within the grace. Lost work per kill is said
against the interval each saves at, and from each session's own ``checkpoint.saved``
events, what a save held the training, and the interval that would cost 1% of the steps.

**What each fault cost**, a second table: the steps trained since the last save and
thrown away (``lost work``, at the speed before the fault), then the time from the fault
to the next process's first step, split into noticing it and starting the next process
(``notice``: for a hang, the deadline; for a preemption, the final save, the exit and the
orchestrator's start), its imports and the model's build (none with a warm standby but
the build), its ``restore`` and the time to its first step,
and the speed of the next process against the one before. Each fault's floor is what it
cannot cost less than: a kill or an exception, the lost work plus a restore; a hang, that
plus the deadline (``--stuck-after``); a preemption, a cold start and a restore (the
command is started again on a "new node", without a standby; its final save is part of
``notice``). A cold start is the system's own, measured in its fault-free run: from the
command's start to its trainer's imports done (for ``asupervisor run``, its standby's imports
and the fork; for the others, a new interpreter's). ``over floor`` is what the system
added. Goodput is productive steps per wall-clock second under faults over the same
without faults. This VM's speed drifts by
up to 2x between runs minutes apart, so each run also measures its own training speed
(steps per second while its processes trained, recorded by the trainer), and "goodput,
same run" is productive steps over (that speed x the wall time): the share of the wall
time that went into steps that were kept. Productive steps are the
target when the run finished. A run that takes no step for ``--stall-secs`` (a hang
nobody notices) is cut then, and one still training is cut at ``--budget`` times its
fault-free duration; either is charged that whole budget as its wall time (a person
restarting it would come no earlier), and its productive steps are those of its
newest checkpoint, from which a person restarting it would go on.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "benchmarks" / "goodput_trainer.py"
HANG = signal.SIGRTMIN + 1
PREEMPT_GRACE = 30.0
KINDS = ["kill", "kill", "kill", "exception", "hang", "preempt"]


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float  # wall-clock time it was delivered
    pid: int  # the process it was delivered to


@dataclass(frozen=True)
class Start:
    """One trainer process's start, as it recorded it (``start-<pid>``)."""

    pid: int
    begun: float
    imported: float
    restored: float
    restored_step: int
    first: float


@dataclass(frozen=True)
class Where:
    """One run's places: its work directory (the harness's records), its logdir, and its
    local tier's directory (``None``: no local tier)."""

    workdir: str
    logdir: str
    local: str | None


@dataclass
class Result:
    system: str
    faults: bool
    wall: float = 0.0
    productive: int = 0
    finished: bool = False
    restarts: int = 0  # top-level starts after the first (the "orchestrator's" restarts)
    hung_at: float | None = None  # when the hang came, if the run never got past it
    recoveries: list[tuple[str, float]] = field(default_factory=list)  # (fault, seconds)
    speed: float = 0.0  # steps per second while its processes trained (this run's machine)
    stalled: bool = False  # cut because no step was taken for --stall-secs
    costs: list[dict[str, object]] = field(default_factory=list)  # one row per fault
    cold_start: float | None = None  # the command's start to its first trainer's imports
    saves: list[dict[str, object]] = field(default_factory=list)  # checkpoint.saved events
    restores: list[dict[str, object]] = field(default_factory=list)  # checkpoint.restored
    mirrored: list[dict[str, object]] = field(default_factory=list)  # checkpoint.mirrored
    met: int = 0  # the faults of the schedule delivered to it (the rest came after its end)

    @property
    def rate(self) -> float:
        return self.productive / self.wall

    @property
    def own_goodput(self) -> float:
        """The share of the wall time that went into steps that were kept, at the speed the
        machine trained at during this same run: immune to the machine's drift between runs."""
        return self.productive / (self.speed * self.wall)


def command(system: str, where: Where, args: argparse.Namespace) -> list[str]:
    trainer = [
        sys.executable,
        str(TRAINER),
        system.split("-")[0],  # asv-local trains as asv: the runner turns the tier on
        where.workdir,
        "--steps",
        str(args.steps),
        "--save-steps",
        str(args.save_steps),
        "--logdir",
        where.logdir,
    ]
    if system.startswith("asv"):
        local = []
        if where.local is not None:
            local = ["--local-dir", where.local, "--local-save-secs", str(args.local_save_secs)]
        return [
            sys.executable,
            "-m",
            "asupervisor",
            "run",
            "--logdir",
            where.logdir,
            *local,
            "--standby",
            "--stuck-after",
            str(args.stuck_after),
            "--startup-timeout",
            "300",
            "--grace",
            str(PREEMPT_GRACE - 5),
            "--",
            *trainer,
        ]
    quoted = " ".join(f"'{part}'" for part in trainer)
    return ["bash", "-c", f"until {quoted}; do sleep 1; done"]


def trainer_pid(workdir: str, name: str = "pid") -> tuple[int, float] | None:
    try:
        pid, when = Path(workdir, name).read_text().split()
    except (OSError, ValueError):
        return None
    return int(pid), float(when)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def productive_steps(system: str, where: Where, args: argparse.Namespace) -> int:
    """The optimizer steps in the newest state a restart would go on from (on the same
    host: the local tier's too)."""
    if Path(where.workdir, "done").exists():
        return args.steps
    if system == "fit":
        try:
            metadata = json.loads(
                Path(where.workdir, "backup", "training_metadata.json").read_text()
            )
        except OSError:
            return 0
        return int(metadata["epoch"]) * 1000  # BackupAndRestore restarts the epoch
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(where.logdir)
    steps = 0 if latest is None else int(latest.rsplit("-", 1)[1])
    if where.local is not None:  # the local tier (a directory per logdir under it)
        for index in Path(where.local).glob("*/*.index"):
            steps = max(steps, int(index.name.removesuffix(".index").rsplit("-", 1)[1]))
    return steps


def session_events(workdir: str, name: str) -> list[dict[str, object]]:
    """The sessions' ``name`` events (``events-<pid>``, written by the ``asv`` trainer)."""
    found = []
    for path in Path(workdir).glob("events-*"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if event.get("event") == name:
                found.append(event | {"pid": int(path.name.split("-")[1])})
    return sorted(found, key=lambda e: float(e["at"]))


def last_progress(workdir: str, began: float) -> float:
    """When a process of the run last recorded steps, in seconds since the run began (0
    before any record: the start-up counts as progress until the stall limit)."""
    newest = max((p.stat().st_mtime for p in Path(workdir).glob("steps-*")), default=None)
    if newest is None:
        return 0.0
    return max(0.0, time.monotonic() - (time.time() - newest) - began)


def training_speed(workdir: str) -> float:
    """Steps per second over the spans in which the run's processes trained (between the
    first and last record of each: start-up and the time after the last record excluded)."""
    steps = seconds = 0.0
    for path in Path(workdir).glob("steps-*"):
        records = step_records(path)
        if len(records) >= 2:
            (t0, s0, _), (t1, s1, _) = records[0], records[-1]
            steps += s1 - s0
            seconds += t1 - t0
    return steps / seconds if seconds else float("nan")


def step_records(path: Path) -> list[tuple[float, int, int]]:
    """``(time, this process's steps, global step)`` records of one process."""
    records = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            records.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return records


def process_speed(workdir: str, pid: int) -> float | None:
    path = Path(workdir, f"steps-{pid}")
    records = step_records(path) if path.exists() else []
    if len(records) < 2 or records[-1][0] <= records[0][0]:
        return None
    return (records[-1][1] - records[0][1]) / (records[-1][0] - records[0][0])


def starts(workdir: str) -> list[Start]:
    found = []
    for path in Path(workdir).glob("start-*"):
        try:
            begun, imported, restored, step, first = path.read_text().split()
        except (OSError, ValueError):
            continue
        pid = int(path.name.split("-")[1])
        found.append(Start(pid, float(begun), float(imported), float(restored), int(step),
                           float(first)))  # fmt: skip
    return sorted(found, key=lambda s: s.first)


def cold_start(workdir: str, began_wall: float) -> float | None:
    """From the command's first start to its first trainer's imports done."""
    known = starts(workdir)
    return known[0].imported - began_wall if known else None


def fault_costs(
    system: str,
    faults: list[Fault],
    workdir: str,
    began_wall: float,
    cold: float | None,
    args: argparse.Namespace,
) -> list[dict[str, object]]:
    """One row per fault: what it cost, split as the module docstring says; ``cold`` is
    the system's cold start, from its fault-free run."""
    rows: list[dict[str, object]] = []
    known = starts(workdir)
    overall = training_speed(workdir)
    for fault in faults:
        # A fault right after a start leaves too few records for the process's own speed.
        speed = process_speed(workdir, fault.pid) or (overall if overall > 0 else None)
        path = Path(workdir, f"steps-{fault.pid}")
        records = [r for r in step_records(path) if r[0] <= fault.at] if path.exists() else []
        after = next((s for s in known if s.first > fault.at and s.pid != fault.pid), None)
        row: dict[str, object] = {"system": system, "fault": fault.kind,
                                  "at s": round(fault.at - began_wall, 1)}  # fmt: skip
        if after is None or speed is None or not records:
            rows.append(row | {"cost s": "not recovered"})
            continue
        t_last, _, step_last = records[-1]
        at_fault = step_last + speed * (fault.at - t_last)  # within one record's steps
        lost_steps = max(0.0, at_fault - after.restored_step) if after.restored_step >= 0 else 0.0
        lost = lost_steps / speed
        restore = after.restored - after.imported
        first = after.first - after.restored
        imports = after.imported - after.begun
        # A preempted command starts again cold (a new node has no standby): a cold start
        # is part of its floor (the standby's imports are in "notice" for asupervisor run,
        # the trainer's in "imports" for the others); its final save is part of "notice".
        if fault.kind == "preempt":
            floor = restore + first + (cold if cold is not None else imports)
        else:
            floor = restore + first + lost
        if fault.kind == "hang":
            floor += args.stuck_after
        recovery = after.first - fault.at
        speed_after = process_speed(workdir, after.pid)
        came_from = [e for e in session_events(workdir, "checkpoint.restored")
                     if e["pid"] == after.pid]  # fmt: skip
        rows.append(
            row
            | {
                "lost steps": round(lost_steps),
                "lost work s": round(lost, 2),
                "notice s": round(after.begun - fault.at, 2),
                "imports, build s": round(imports, 2),
                "restore s": round(restore, 2),
                "to first step s": round(first, 2),
                "cost s": round(lost + recovery, 2),
                "floor s": round(floor, 2),
                "over floor s": round(lost + recovery - floor, 2),
                "speed after %": None if speed_after is None else round(100 * speed_after / speed),
                "restored from": str(came_from[0].get("tier") or "logdir") if came_from else "",
            }
        )
    return rows


def start(cmd: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def place(system: str, args: argparse.Namespace) -> Where:
    """A new run's places: a fresh work directory, a fresh logdir on the store."""
    workdir = tempfile.mkdtemp(prefix=f"goodput-{system}-")
    logdir = os.path.join(workdir, "logdir")
    if args.gcs is not None:
        logdir = args.gcs.new_path(f"goodput-{system}")
    local = os.path.join(workdir, "local-tier") if system == "asv-local" else None
    return Where(workdir, logdir, local)


def run(
    system: str,
    schedule: list[tuple[float, str]],
    budget: float,
    args: argparse.Namespace,
    keep: str,
    cold: float | None = None,
) -> Result:
    where = place(system, args)
    workdir = where.workdir
    result = Result(system, bool(schedule))
    delivered: list[Fault] = []
    log = open(os.path.join(keep, f"{system}-{'faults' if schedule else 'clean'}.log"), "wb")
    cmd = command(system, where, args)
    began, began_wall = time.monotonic(), time.time()
    proc = start(cmd, log)
    pending = list(schedule)
    waiting: list[tuple[str, float, int]] = []  # faults whose recovery is not seen yet
    faulted: set[int] = set()
    stalled = False
    try:
        while True:
            now = time.monotonic() - began
            if Path(workdir, "done").exists() and proc.poll() is not None:
                result.finished = True
                break
            if proc.poll() is not None:  # preempted, or the loop gave up: start it again
                proc = start(cmd, log)
                result.restarts += 1
            if now > budget:
                break
            if now - last_progress(workdir, began) > args.stall_secs:
                stalled = True  # hung, and nobody comes: it would stay so
                break
            current = trainer_pid(workdir)
            if current is not None:
                for kind, at, pid in list(waiting):
                    if current[0] != pid:  # a new process trains: recovered
                        result.recoveries.append((kind, current[1] - at))
                        waiting.remove((kind, at, pid))
            if pending and now >= pending[0][0] and current is not None:
                pid = current[0]
                if alive(pid) and pid not in faulted:
                    _, kind = pending.pop(0)
                    faulted.add(pid)
                    waiting.append((kind, time.time(), pid))
                    if kind == "hang":
                        result.hung_at = now
                    delivered.append(Fault(kind, time.time(), pid))
                    deliver(kind, pid, proc)
                    if kind == "preempt" and where.local is not None:
                        shutil.rmtree(where.local, ignore_errors=True)  # a new node
            time.sleep(0.05)
        # A run cut by the budget or by a stall is charged the whole budget: a person
        # restarting it would come no earlier.
        result.wall = time.monotonic() - began if result.finished else budget
        result.stalled = stalled
        if result.finished:
            result.hung_at = None
        elif waiting and any(kind == "hang" for kind, _, _ in waiting):
            pass  # never recovered from the hang
        else:
            result.hung_at = None
    finally:
        kill_group(proc, signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)
        result.productive = productive_steps(system, where, args)
        result.saves = session_events(workdir, "checkpoint.saved")
        result.restores = session_events(workdir, "checkpoint.restored")
        result.mirrored = session_events(workdir, "checkpoint.mirrored")
        result.speed = training_speed(workdir)
        result.cold_start = cold_start(workdir, began_wall)
        result.costs = fault_costs(system, delivered, workdir, began_wall, cold, args)
        result.met = len(delivered)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def deliver(kind: str, pid: int, top: subprocess.Popen[bytes]) -> None:
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
    elif kind == "exception":
        os.kill(pid, signal.SIGUSR2)
    elif kind == "hang":
        os.kill(pid, HANG)
    else:  # the node goes away: SIGTERM to the group, SIGKILL after the grace
        kill_group(top, signal.SIGTERM)
        try:
            top.wait(PREEMPT_GRACE)
        except subprocess.TimeoutExpired:
            kill_group(top, signal.SIGKILL)
            top.wait()


def make_schedule(duration: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    while True:
        times = sorted(rng.uniform(0.1 * duration, 0.85 * duration) for _ in kinds)
        if min(b - a for a, b in itertools.pairwise(times)) > 0.08 * duration:
            return list(zip(times, kinds, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50000)
    parser.add_argument("--save-steps", type=int, default=200)
    parser.add_argument("--stuck-after", type=float, default=5.0)
    parser.add_argument(
        "--budget",
        type=float,
        default=3.0,
        help="a run that does not finish is cut at this times its fault-free time",
    )
    parser.add_argument(
        "--stall-secs",
        type=float,
        default=60.0,
        help="a run that takes no step for this long is cut, charged the whole budget",
    )
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument(
        "--systems",
        default=None,
        help="of asv, asv-local, loop, fit (default: asv,loop,fit; with --local-tier: "
        "asv,asv-local)",
    )
    parser.add_argument(
        "--store",
        choices=("local", "gcs"),
        default="local",
        help="where the logdir is: a local directory, or gs:// on a loopback GCS server",
    )
    parser.add_argument(
        "--local-tier",
        action="store_true",
        help="compare asupervisor run with and without --local-dir (asv, asv-local)",
    )
    parser.add_argument(
        "--local-save-secs",
        type=float,
        default=1.0,
        help="asv-local: seconds between two saves to the local tier (default: 1)",
    )
    parser.add_argument("--logs", default=None, help="keep the runs' output here")
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="the faults on a two-node SLURM cluster (ASV_SLURM_DIR): a two-worker job under "
        "asupervisor run --slurm (benchmarks/goodput_slurm.py)",
    )
    parser.add_argument("--slurm-workdir", default=None, help="(--slurm) where the job runs")
    args = parser.parse_args()
    if args.slurm:
        import goodput_slurm

        goodput_slurm.main(args)
        return
    keep = args.logs or tempfile.mkdtemp(prefix="goodput-logs-")
    os.makedirs(keep, exist_ok=True)
    systems = (args.systems or ("asv,asv-local" if args.local_tier else "asv,loop,fit")).split(",")
    unknown = set(systems) - set(NAMES)
    if unknown:
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))} (of {', '.join(NAMES)})")
    with contextlib.ExitStack() as stack:
        args.gcs = None
        if args.store == "gcs":
            sys.path.insert(0, str(ROOT))
            from tests.gcs_fixture import FakeGcs

            args.gcs = stack.enter_context(FakeGcs())
            args.gcs.apply()  # the harness (it reads the logdir) and every process it starts
        measure(args, systems, keep)


NAMES = {
    "asv": "`asupervisor run --standby` + `sess.train`",
    "asv-local": "`asupervisor run --standby --local-dir` + `sess.train`",
    "loop": "`until` loop + hand-written `CheckpointManager` loop",
    "fit": "`until` loop + Keras `fit` + `BackupAndRestore`",
}


def measure(args: argparse.Namespace, systems: list[str], keep: str) -> None:
    """The fault-free runs, the schedule, the runs under faults (each system in turn, in
    that order, so that a slower or faster spell of the machine falls on all), the tables."""
    clean = {}
    for system in systems:
        clean[system] = run(system, [], 10**6, args, keep)
        if not clean[system].finished:  # no duration to draw the faults' times from
            sys.exit(f"{system}: the fault-free run did not finish (its log: {keep})")
        print(
            f"{system}: fault-free {clean[system].wall:.1f} s, {clean[system].rate:.1f} steps/s, "
            f"cold start {clean[system].cold_start or float('nan'):.1f} s",
            flush=True,
        )
    # Drawn within the shortest fault-free run: a faster system would otherwise end
    # before the last faults come, and meet fewer (no comparison then).
    schedule = make_schedule(min(c.wall for c in clean.values()), args.seed)
    print("schedule: " + ", ".join(f"{kind} at {at:.0f} s" for at, kind in schedule), flush=True)
    faulted = {}
    for system in systems:
        budget = args.budget * clean[system].wall
        faulted[system] = run(system, schedule, budget, args, keep, clean[system].cold_start)
        r = faulted[system]
        print(
            f"{system}: with faults {r.wall:.1f} s, {r.productive} productive steps, "
            f"finished {r.finished}, met {r.met} of {len(schedule)} faults, "
            f"recoveries {r.recoveries}",
            flush=True,
        )
    names = {system: NAMES[system] for system in systems}
    print(
        f"\n{args.steps} steps, a save every {args.save_steps}"
        + (f", a local save every {args.local_save_secs:g} s" if "asv-local" in systems else "")
        + f", the logdir on {'gs:// (loopback GCS server)' if args.gcs else 'a local disk'}"
        + "; faults: "
        + ", ".join(f"{kind} at {at:.0f} s" for at, kind in schedule)
        + "\n"
    )
    print(
        "| system | fault-free: wall, steps/s | with faults: wall, productive steps/s | "
        "goodput (vs the fault-free run) | goodput, same run (drift-free) | "
        "finished without a person | seconds to train again after each fault |"
    )
    print("|---|---|---|---|---|---|---|")
    for system in systems:
        c, f = clean[system], faulted[system]
        done = finished(f).replace("no:", "**no**:", 1)
        recoveries = ", ".join(f"{kind} {secs:.1f}" for kind, secs in f.recoveries)
        print(
            f"| {names[system]} | {c.wall:.0f} s, {c.rate:.1f} | {f.wall:.0f} s, {f.rate:.1f} | "
            f"{100 * f.rate / c.rate:.1f}% | **{100 * f.own_goodput:.1f}%** (fault-free run: "
            f"{100 * c.own_goodput:.1f}%) | {done} | {recoveries} |"
        )
    costs = [row for system in systems for row in faulted[system].costs]
    print("\nwhat each fault cost (seconds):\n")
    columns = list(dict.fromkeys(key for row in costs for key in row))
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for row in costs:
        print("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    kills = kill_losses(args, systems, clean, faulted)
    saving = save_costs(systems, clean)
    ratios = tier_ratios(systems, clean, faulted, kills, len(schedule))
    print(f"\nlogs: {keep}")
    write_results(args, schedule, clean, faulted, names, costs, kills, saving, ratios)


def tier(path: object) -> str:
    """Which tier a save went to, from its path."""
    return "local" if "local-tier" in str(path) else "logdir"


def kill_losses(
    args: argparse.Namespace,
    systems: list[str],
    clean: dict[str, Result],
    faulted: dict[str, Result],
) -> list[dict[str, object]]:
    """Lost work per kill against the interval each system saves at: a kill loses at
    most the interval (in seconds, at the speed of its fault-free run), and with a save
    written in the background, the interval and the write (a kill just before a commit
    goes back to the save before it)."""
    rows: list[dict[str, object]] = []
    print("\nlost work per kill (a SIGKILL, an exception, a hang: the steps since the newest "
          "checkpoint a restart went on from):\n")  # fmt: skip
    print("| system | save interval s | a background write s | lost work s, each | most | mean "
          "| most / interval |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for system in systems:
        speed = clean[system].speed
        interval = args.local_save_secs if system == "asv-local" else args.save_steps / speed
        # A save to the store holds the training until it is written: no write behind it.
        local = [float(e["seconds"]) for e in clean[system].saves if tier(e.get("path")) == "local"]  # type: ignore[arg-type]
        write = statistics.median(local) if local else 0.0
        lost = [
            float(row["lost work s"])  # type: ignore[arg-type]
            for row in faulted[system].costs
            if row["fault"] in ("kill", "exception", "hang") and "lost work s" in row
        ]
        most = max(lost, default=float("nan"))
        mean = sum(lost) / len(lost) if lost else float("nan")
        print(
            f"| {system} | {interval:.2f} | {write:.2f} | {', '.join(f'{x:.2f}' for x in lost)} | "
            f"{most:.2f} | {mean:.2f} | {most / interval:.2f} |"
        )
        rows.append({"system": system, "save interval s": round(interval, 2),
                     "a background write s": round(write, 3), "lost work s": lost,
                     "most s": round(most, 2), "mean s": round(mean, 2),
                     "most / interval": round(most / interval, 2)})  # fmt: skip
    return rows


def tier_ratios(
    systems: list[str],
    clean: dict[str, Result],
    faulted: dict[str, Result],
    kills: list[dict[str, object]],
    scheduled: int,
) -> list[dict[str, object]]:
    """With and without the local tier (``asv-local`` against ``asv``), side by side and
    as ratios: goodput, each fault's cost and its cost over the floor (the faults in the
    order both met them), lost work per kill. Comparable only if both met every fault."""
    if not {"asv", "asv-local"} <= set(systems):
        return []
    one, two = faulted["asv"], faulted["asv-local"]
    fair = one.met == two.met == scheduled
    met = "yes" if fair else f"**no** ({one.met}, {two.met})"
    print(f"\nwith the local tier against without (asv-local / asv); both met all {scheduled} "
          f"faults: {met}\n")  # fmt: skip
    print("| measure | asv | asv-local | asv-local / asv |\n|---|---|---|---|")
    rows: list[dict[str, object]] = []

    def add(measure: str, a: float | None, b: float | None) -> None:
        ratio = b / a if a and b is not None else None
        rows.append({"measure": measure, "asv": a, "asv-local": b,
                     "asv-local / asv": None if ratio is None else round(ratio, 2)})  # fmt: skip
        show = [f"{x:.2f}" if isinstance(x, (int, float)) else "" for x in (a, b, ratio)]
        print(f"| {measure} | " + " | ".join(show) + " |")

    add("goodput %, same run", 100 * one.own_goodput, 100 * two.own_goodput)
    add("goodput % (vs its fault-free run)", 100 * one.rate / clean["asv"].rate,
        100 * two.rate / clean["asv-local"].rate)  # fmt: skip
    add("with faults: wall s", one.wall, two.wall)
    for a, b in zip(one.costs, two.costs, strict=False):
        if a["fault"] != b["fault"]:
            break  # the schedules diverged (a fault not met): no pairs after it
        for key, name in (("cost s", "cost"), ("over floor s", "over floor")):
            x, y = a.get(key), b.get(key)
            add(f"{a['fault']} at {a['at s']} / {b['at s']} s: {name} s",
                float(x) if isinstance(x, (int, float)) else None,
                float(y) if isinstance(y, (int, float)) else None)  # fmt: skip
    most = {row["system"]: row["most s"] for row in kills}
    add("lost work per kill, most s", float(most["asv"]), float(most["asv-local"]))  # type: ignore[arg-type]
    rows.append({"measure": "both met every fault", "asv": one.met, "asv-local": two.met,
                 "asv-local / asv": "yes" if fair else "no"})  # fmt: skip
    return rows


def number(event: dict[str, object], key: str) -> float:
    return float(event[key])  # type: ignore[arg-type]


def save_costs(systems: list[str], clean: dict[str, Result]) -> list[dict[str, object]]:
    """What a save held the training in each fault-free run (its sessions' own
    ``checkpoint.saved``: ``blocked_seconds``), by tier, and the interval between two
    saves at which that is 1% of the time: the shortest a run can afford."""
    rows: list[dict[str, object]] = []
    print("\nwhat a save held the training (fault-free runs, medians):\n")
    print("| system | tier | saves | held s | written s | interval at 1% s | at 1%, steps |")
    print("|---|---|---|---|---|---|---|")
    for system in systems:
        result = clean[system]
        by_tier: dict[str, list[dict[str, object]]] = {}
        for event in result.saves:
            by_tier.setdefault(tier(event.get("path")), []).append(event)
        for name, events in sorted(by_tier.items()):
            held = statistics.median(float(e["blocked_seconds"]) for e in events)  # type: ignore[arg-type]
            written = statistics.median(float(e["seconds"]) for e in events)  # type: ignore[arg-type]
            interval = 100 * held
            print(
                f"| {system} | {name} | {len(events)} | {held:.4f} | {written:.4f} | "
                f"{interval:.2f} | {interval * result.speed:.0f} |"
            )
            rows.append({"system": system, "tier": name, "saves": len(events),
                         "held s": round(held, 4), "written s": round(written, 4),
                         "interval at 1% s": round(interval, 2),
                         "interval at 1% steps": round(interval * result.speed)})  # fmt: skip
        mirrored = result.mirrored
        if mirrored:
            local = {e["step"]: number(e, "at") for e in by_tier.get("local", [])}
            lags = [number(e, "at") - local[e["step"]] for e in mirrored if e["step"] in local]
            copy = statistics.median(number(e, "seconds") for e in mirrored)
            lag = statistics.median(lags) if lags else float("nan")
            print(
                f"| {system} | mirror to the logdir | {len(mirrored)} of {len(local)} | - | "
                f"{copy:.4f} (a copy) | lag {lag:.2f} s (local commit to logdir commit) | |"
            )
            rows.append(
                {
                    "system": system,
                    "tier": "mirror to the logdir",
                    "saves": len(mirrored),
                    "written s": round(copy, 4),
                    "mirror lag s": round(lag, 3),
                }
            )
    return rows


LOAD_AT_START = os.getloadavg()


def load() -> str:
    """The machine's load while the benchmark ran (it is shared: say what was seen)."""
    end = os.getloadavg()
    return (
        f"load average (1/5/15 min) {' / '.join(f'{x:.1f}' for x in LOAD_AT_START)} at the "
        f"start, {' / '.join(f'{x:.1f}' for x in end)} at the end, on {os.cpu_count()} cores"
    )


def summary_row(system: str, clean: Result, faulted: Result) -> dict[str, object]:
    """A system's row of the results: its fault-free run against its run under faults
    (``goodput.json``, ``goodput_tiers.json``, ``goodput_slurm.json``)."""
    return {
        "system": system,
        "fault-free: wall s": round(clean.wall, 1),
        "fault-free: steps/s": round(clean.rate, 1),
        "cold start s": None if clean.cold_start is None else round(clean.cold_start, 2),
        "with faults: wall s": round(faulted.wall, 1),
        "with faults: productive steps/s": round(faulted.rate, 1),
        "goodput % (vs the fault-free run)": round(100 * faulted.rate / clean.rate, 1),
        "goodput %, same run (drift-free)": round(100 * faulted.own_goodput, 1),
        "finished without a person": finished(faulted),
    }


def finished(result: Result) -> str:
    """Whether a run under faults finished without a person, and if not, how it ended."""
    if result.finished:
        return "yes"
    if result.hung_at is not None:
        return f"no: hung at {result.hung_at:.0f} s, charged {result.wall:.0f} s"
    return f"no: not finished when cut at {result.wall:.0f} s"


def write_results(
    args: argparse.Namespace,
    schedule: list[tuple[float, str]],
    clean: dict[str, Result],
    faulted: dict[str, Result],
    names: dict[str, str],
    costs: list[dict[str, object]],
    kills: list[dict[str, object]],
    saving: list[dict[str, object]],
    ratios: list[dict[str, object]],
) -> None:
    """The figures the docs show (``benchmarks/results/goodput.json``), so that no table
    is copied by hand."""
    from _results import write

    rows = []
    for system, c in clean.items():
        f = faulted[system]
        rows.append(
            {
                **summary_row(names[system], c, f),
                "faults met": f"{f.met} of {len(schedule)}",
                "seconds to train again after each fault": [
                    f"{kind} {secs:.1f}" for kind, secs in f.recoveries
                ],
            }
        )
    # The two tiers on a store get a file of their own: goodput.json stays the comparison
    # with the shell loops on a local disk.
    write(
        "goodput_tiers" if args.local_tier or args.gcs else "goodput",
        rows,
        steps=args.steps,
        save_steps=args.save_steps,
        faults=[[kind, round(at)] for at, kind in schedule],
        load=load(),
        costs=costs,
        store="gs:// (loopback GCS server)" if args.gcs else "local disk",
        local_save_secs=args.local_save_secs if "asv-local" in clean else None,
        tables={
            "Lost work per kill (a SIGKILL, an exception, a hang), against its interval": kills,
            "What a save held the training (fault-free runs, medians), and the interval at "
            "which that is 1% of the time": saving,
            **({"With the local tier against without, the same faults": ratios} if ratios else {}),
        },
        restores={
            system: [
                {"step": e.get("step"), "path": e.get("path"), "seconds": e.get("seconds")}
                for e in faulted[system].restores
            ]
            for system in clean
        },
    )


if __name__ == "__main__":
    main()
