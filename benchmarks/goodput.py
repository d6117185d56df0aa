"""Goodput under faults, with no person in the loop: `asupervisor run` + `sess.train`
against a shell `until` loop around a hand-written CheckpointManager loop and around
Keras `fit` + `BackupAndRestore`.

    python benchmarks/goodput.py                       # about an hour here
    python benchmarks/goodput.py --steps 4000           # a smoke run (faults too close)
    python benchmarks/goodput.py --slurm --steps 3000   # two workers on two SLURM nodes

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
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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

    @property
    def rate(self) -> float:
        return self.productive / self.wall

    @property
    def own_goodput(self) -> float:
        """The share of the wall time that went into steps that were kept, at the speed the
        machine trained at during this same run: immune to the machine's drift between runs."""
        return self.productive / (self.speed * self.wall)


def command(system: str, workdir: str, args: argparse.Namespace) -> list[str]:
    trainer = [
        sys.executable,
        str(TRAINER),
        system,
        workdir,
        "--steps",
        str(args.steps),
        "--save-steps",
        str(args.save_steps),
    ]
    if system == "asv":
        logdir = os.path.join(workdir, "logdir")
        return [
            sys.executable,
            "-m",
            "asupervisor",
            "run",
            "--logdir",
            logdir,
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


def productive_steps(system: str, workdir: str, args: argparse.Namespace) -> int:
    """The optimizer steps in the newest state a restart would go on from."""
    if Path(workdir, "done").exists():
        return args.steps
    if system == "fit":
        try:
            metadata = json.loads(Path(workdir, "backup", "training_metadata.json").read_text())
        except OSError:
            return 0
        return int(metadata["epoch"]) * 1000  # BackupAndRestore restarts the epoch
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(os.path.join(workdir, "logdir"))
    return 0 if latest is None else int(latest.rsplit("-", 1)[1])


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
            }
        )
    return rows


def start(cmd: list[str], log: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,  # type: ignore[arg-type]
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run(
    system: str,
    schedule: list[tuple[float, str]],
    budget: float,
    args: argparse.Namespace,
    keep: str,
    cold: float | None = None,
) -> Result:
    workdir = tempfile.mkdtemp(prefix=f"goodput-{system}-")
    result = Result(system, bool(schedule))
    delivered: list[Fault] = []
    log = open(os.path.join(keep, f"{system}-{'faults' if schedule else 'clean'}.log"), "wb")
    cmd = command(system, workdir, args)
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
        result.productive = productive_steps(system, workdir, args)
        result.speed = training_speed(workdir)
        result.cold_start = cold_start(workdir, began_wall)
        result.costs = fault_costs(system, delivered, workdir, began_wall, cold, args)
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
    parser.add_argument("--systems", default="asv,loop,fit")
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
    systems = args.systems.split(",")
    clean = {}
    for system in systems:
        clean[system] = run(system, [], 10**6, args, keep)
        print(
            f"{system}: fault-free {clean[system].wall:.1f} s, {clean[system].rate:.1f} steps/s, "
            f"cold start {clean[system].cold_start or float('nan'):.1f} s",
            flush=True,
        )
    schedule = make_schedule(clean[systems[0]].wall, args.seed)
    print("schedule: " + ", ".join(f"{kind} at {at:.0f} s" for at, kind in schedule), flush=True)
    faulted = {}
    for system in systems:
        budget = args.budget * clean[system].wall
        faulted[system] = run(system, schedule, budget, args, keep, clean[system].cold_start)
        r = faulted[system]
        print(
            f"{system}: with faults {r.wall:.1f} s, {r.productive} productive steps, "
            f"finished {r.finished}, recoveries {r.recoveries}",
            flush=True,
        )
    names = {
        "asv": "`asupervisor run --standby` + `sess.train`",
        "loop": "`until` loop + hand-written `CheckpointManager` loop",
        "fit": "`until` loop + Keras `fit` + `BackupAndRestore`",
    }
    print(
        f"\n{args.steps} steps, a save every {args.save_steps}; faults: "
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
    print(f"\nlogs: {keep}")
    write_results(args, schedule, clean, faulted, names, costs)


LOAD_AT_START = os.getloadavg()


def load() -> str:
    """The machine's load while the benchmark ran (it is shared: say what was seen)."""
    end = os.getloadavg()
    return (
        f"load average (1/5/15 min) {' / '.join(f'{x:.1f}' for x in LOAD_AT_START)} at the "
        f"start, {' / '.join(f'{x:.1f}' for x in end)} at the end, on {os.cpu_count()} cores"
    )


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
) -> None:
    """The figures the docs show (``benchmarks/results/goodput.json``), so that no table
    is copied by hand."""
    from _results import write

    rows = []
    for system, c in clean.items():
        f = faulted[system]
        rows.append(
            {
                "system": names[system],
                "fault-free: wall s": round(c.wall, 1),
                "fault-free: steps/s": round(c.rate, 1),
                "cold start s": None if c.cold_start is None else round(c.cold_start, 2),
                "with faults: wall s": round(f.wall, 1),
                "with faults: productive steps/s": round(f.rate, 1),
                "goodput % (vs the fault-free run)": round(100 * f.rate / c.rate, 1),
                "goodput %, same run (drift-free)": round(100 * f.own_goodput, 1),
                "finished without a person": finished(f),
                "seconds to train again after each fault": [
                    f"{kind} {secs:.1f}" for kind, secs in f.recoveries
                ],
            }
        )
    write(
        "goodput",
        rows,
        steps=args.steps,
        save_steps=args.save_steps,
        faults=[[kind, round(at)] for at, kind in schedule],
        load=load(),
        costs=costs,
    )


if __name__ == "__main__":
    main()
