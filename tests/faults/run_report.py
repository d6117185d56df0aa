"""The fault report: N SIGKILLs at random moments, a SIGTERM, and every fault, on real processes.

    python tests/faults/run_report.py              # 50 kills (5 to 10 minutes)
    python tests/faults/run_report.py --kills 10

Every row runs tests/faults/trainer.py in subprocesses, then checks the logdir:
every checkpoint on disk must read back whole and hold one step boundary. A full run
(no --only) writes benchmarks/results/fault_report.json, the table of
docs/shutdowns.md (``python docs/_hooks/measured.py`` writes it into the page).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # _results: where measured tables are written
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _results import write  # noqa: E402

from tests.faults.harness import Trainer, checkpoint_problems, kill_trials  # noqa: E402

SAVE_STEPS = 5


@dataclass
class Row:
    scenario: str
    trials: int
    resumed: int | None  # None: the scenario does not resume
    lost: str
    corrupt: int
    outcome: str
    seconds: float


def expect_failure(
    logdir: str, fault: str, words: list[str], prepare: Callable[[], None] | None = None
) -> str:
    run = Trainer(logdir, "--save-steps", str(SAVE_STEPS), "--fault", fault)
    if prepare is not None:
        prepare()
    code = run.proc.wait(120)
    text = run.stderr_text()
    missing = [w for w in words if w not in text]
    if code in (0, 42) or missing:
        return f"UNEXPECTED (exit {code}, missing {missing})"
    return f"exit {code}: {words[0]}"


def scenario(name: str, body: Callable[[str], tuple[int, int | None, str, str]]) -> Row:
    with tempfile.TemporaryDirectory() as scratch:
        logdir = os.path.join(scratch, "run")
        started = time.monotonic()
        trials, resumed, lost, outcome = body(logdir)
        _, problems = checkpoint_problems(logdir) if os.path.isdir(logdir) else (0, [])
        if problems:
            outcome += f"; BAD CHECKPOINTS: {problems}"
        return Row(name, trials, resumed, lost, len(problems), outcome, time.monotonic() - started)


def kills(n: int, seed: int, mode: str) -> Callable[[str], tuple[int, int | None, str, str]]:
    def body(logdir: str) -> tuple[int, int | None, str, str]:
        extra = ["--megabytes", "16"] + (["--async"] if mode == "async" else [])
        report = kill_trials(logdir, n, seed, SAVE_STEPS, *extra)
        lost = f"{max(report.lost_steps)} (interval {SAVE_STEPS})"
        outcome = "every run resumed" if report.went_back == 0 else f"{report.went_back} went back"
        outcome += f"; {report.orphans} orphans, {report.checkpoints} on disk after a clean run"
        return report.trials, report.resumed, lost, outcome

    return body


def sigterm(logdir: str) -> tuple[int, int | None, str, str]:
    run = Trainer(logdir, "--save-steps", str(SAVE_STEPS))
    run.wait_for(lambda: run.last_step >= 20)
    run.proc.send_signal(signal.SIGTERM)
    code = run.proc.wait(60)
    again = Trainer(logdir, "--max-steps", "0")
    restored = again.wait_restored()
    again.proc.wait(60)
    lost = run.last_step - restored
    return (
        1,
        int(restored == run.last_step),
        f"{lost}",
        f"exit {code}, final save at {run.last_saved}",
    )


def full_disk(logdir: str) -> tuple[int, int | None, str, str]:
    outcome = expect_failure(logdir, "full-disk", ["CheckpointSaveError", "checkpoint.failed"])
    return 1, None, "-", outcome


def unwritable(logdir: str) -> tuple[int, int | None, str, str]:
    os.makedirs(logdir)
    trainer_ready = Trainer(logdir, "--save-steps", str(SAVE_STEPS))
    trainer_ready.wait_for(lambda: trainer_ready.last_step >= 10)
    subprocess.run(["chattr", "+i", logdir], check=True)
    try:
        code = trainer_ready.proc.wait(120)
    finally:
        subprocess.run(["chattr", "-i", logdir], check=True)
    ok = code != 0 and "CheckpointSaveError" in trainer_ready.stderr_text()
    return 1, None, "-", f"exit {code}: CheckpointSaveError" if ok else f"UNEXPECTED exit {code}"


def corrupt_newest(logdir: str) -> tuple[int, int | None, str, str]:
    run = Trainer(logdir, "--save-steps", str(SAVE_STEPS), "--max-steps", "20")
    run.proc.wait(60)
    Path(logdir, "model.ckpt-20.data-00000-of-00001").write_bytes(b"torn")
    again = Trainer(logdir, "--max-steps", "0")
    restored = again.wait_restored()
    again.proc.wait(60)
    Path(logdir, "model.ckpt-20.data-00000-of-00001").unlink()  # the planted damage, not ours
    Path(logdir, "model.ckpt-20.index").unlink()
    fell_back = restored == 15 and "checkpoint.fallback" in again.stderr_text()
    return (
        1,
        int(fell_back),
        "-",
        "fell back to 15" if fell_back else f"UNEXPECTED restored {restored}",
    )


def fault(name: str, words: list[str]) -> Callable[[str], tuple[int, int | None, str, str]]:
    def body(logdir: str) -> tuple[int, int | None, str, str]:
        return 1, None, "-", expect_failure(logdir, name, words)

    return body


def events_deleted(logdir: str) -> tuple[int, int | None, str, str]:
    run = Trainer(
        logdir,
        "--save-steps",
        str(SAVE_STEPS),
        "--fault",
        "events-deleted",
        "--max-steps",
        "60",
        "--pause",
        "0.02",
    )
    code = run.proc.wait(120)
    replaced = "summary.file_lost" in run.stderr_text() and any(Path(logdir).glob("events.out.*"))
    return 1, None, "-", f"exit {code}, new events file" if replaced and code == 0 else "UNEXPECTED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--async-kills", type=int, help="default: a fifth of --kills")
    parser.add_argument("--only", help="run only the scenarios whose name contains this")
    args = parser.parse_args()
    async_kills = args.async_kills or max(1, args.kills // 5)
    scenarios = [
        (f"SIGKILL x{args.kills} (sync)", kills(args.kills, args.seed, "sync")),
        (f"SIGKILL x{async_kills} (async)", kills(async_kills, args.seed, "async")),
        ("SIGTERM", sigterm),
        ("full disk (RLIMIT_FSIZE)", full_disk),
        ("logdir made unwritable", unwritable),
        ("corrupt newest checkpoint", corrupt_newest),
        ("service raises", fault("service", ["ConnectionError", "service.failed"])),
        ("step hangs (watchdog 1 s)", fault("hang", ["StepTimeout", "step.timeout"])),
        ("hook raises", fault("hook", ["RuntimeError: hook failed at step 12"])),
        ("events file deleted", events_deleted),
    ]
    if args.only:
        scenarios = [(n, b) for n, b in scenarios if args.only.lower() in n.lower()]
    header = (
        f"| {'scenario':<28} | trials | resumed | lost steps (max) | corrupt ckpts "
        f"| {'outcome':<44} | seconds |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for name, body in scenarios:
        row = scenario(name, body)
        resumed = "-" if row.resumed is None else row.resumed
        print(
            f"| {row.scenario:<28} | {row.trials:>6} | {resumed:>7} | {row.lost:>16} | "
            f"{row.corrupt:>13} | {row.outcome:<44} | {row.seconds:>7.1f} |",
            flush=True,
        )
        rows.append(
            {
                "scenario": row.scenario,
                "trials": row.trials,
                "resumed": resumed,
                "lost steps (max)": row.lost,
                "corrupt checkpoints": row.corrupt,
                "outcome": row.outcome,
                "seconds": round(row.seconds, 1),
            }
        )
    if args.only is None:  # the docs show the whole report only
        write("fault_report", rows, kills=args.kills, async_kills=async_kills, seed=args.seed)


if __name__ == "__main__":
    main()
