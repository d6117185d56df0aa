"""From a crash to the next first step: `asupervisor run`, cold and with a warm standby.

    python benchmarks/restart_latency.py
    python benchmarks/restart_latency.py --megabytes 100 --trials 3

A trainer with a checkpoint of ``--megabytes`` runs under ``asupervisor run``; once it
trains (and, with ``--standby``, once the standby said it is ready: ``standby.ready``), it
is killed with SIGKILL. The time from the kill to the first step of
the next attempt is measured on the wall clock (the trainer prints when its first step
ended), and split into: the supervisor's restart (the kill to the script's first line),
the script's imports, the session's start-up (the verified restore) and the first step
(tracing). The standby's memory is read from /proc (RSS, and PSS: its share of pages it
has in common with others).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from _results import write

ROOT = Path(__file__).resolve().parents[1]

TRAINER = textwrap.dedent(
    """
    import time
    BEGUN = time.time()
    import os, sys
    import anyio, tensorflow as tf
    import asupervisor as asv
    IMPORTED = time.time()

    logdir, megabytes = sys.argv[1], float(sys.argv[2])
    small = tf.Variable(0.0)
    bulk = tf.Variable(tf.zeros([int(megabytes * 262144)]))  # the checkpoint's bulk

    @tf.function
    def step():
        small.assign_add(1.0)
        return small * 2.0

    async def main():
        sv = asv.Supervisor(logdir, checkpoint={"small": small, "bulk": bulk},
                            save_model_secs=1, save_summaries_secs=0, max_to_keep=2)
        entered = time.time()
        async with sv.session() as sess:
            started = time.time()
            await sess.run(step)
            print("first_step", os.getpid(), os.environ["ASUPERVISOR_ATTEMPT"], BEGUN, IMPORTED,
                  entered, started, time.time(), flush=True)
            while not sess.should_stop():
                await sess.run(step)
                await anyio.sleep(0.001)

    sys.exit(asv.run(main))
    """
)


class Run:
    """`asupervisor run` over the trainer; the trainer's first-step lines collected."""

    def __init__(self, workdir: str, megabytes: float, standby: bool) -> None:
        script = os.path.join(workdir, "trainer.py")
        Path(script).write_text(TRAINER)
        self.logdir = os.path.join(workdir, f"run-{'warm' if standby else 'cold'}")
        args = ["--logdir", self.logdir, "--standby"] if standby else ["--logdir", self.logdir]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asupervisor",
                "run",
                *args,
                "--",
                sys.executable,
                script,
                self.logdir,
                str(megabytes),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.firsts: list[list[float]] = []
        self.standbys: list[int] = []
        self._lock = threading.Condition()
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._err, daemon=True).start()

    def _out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("first_step"):
                with self._lock:
                    self.firsts.append([float(x) for x in line.split()[1:]])
                    self._lock.notify_all()

    def _err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "standby.ready" in line:
                with self._lock:
                    self.standbys.append(int(line.split("pid=")[1].split()[0]))
                    self._lock.notify_all()

    def wait(self, what: str, count: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(getattr(self, what)) < count:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"no {what} #{count}")
                self._lock.wait(0.5)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process, in MiB."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif line.startswith("Pss:"):
            pss = int(line.split()[1])
    return rss / 1024, pss / 1024


def trial(run: Run, attempt: int, standby: bool) -> dict[str, float]:
    """Kill the trainer of ``attempt``; the phases of the next attempt's start."""
    run.wait("firsts", attempt)
    pid = int(run.firsts[attempt - 1][0])
    time.sleep(3.0)  # a checkpoint newer than the restored one: the restart is free
    memory = (0.0, 0.0)
    if standby:
        run.wait("standbys", 1)  # one standby for the run: every start forks from it
        memory = memory_mib(run.standbys[0])
    trainer_memory = memory_mib(pid)
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    run.wait("firsts", attempt + 1)
    _, _, begun, imported, entered, started, first = run.firsts[attempt]
    return {
        "total": first - killed,
        "restart": begun - killed,
        "imports": imported - begun,
        "build": entered - imported,
        "session start (restore)": started - entered,
        "first step": first - started,
        "standby rss": memory[0],
        "standby pss": memory[1],
        "trainer rss": trainer_memory[0],
        "trainer pss": trainer_memory[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=100.0)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for standby in (False, True):
            run = Run(workdir, args.megabytes, standby)
            try:
                rows = [trial(run, n, standby) for n in range(1, args.trials + 1)]
            finally:
                run.stop()
            results["warm standby" if standby else "cold"] = rows
            for row in rows:
                print(f"  {'warm' if standby else 'cold'}: {row['total']:.2f} s", flush=True)
    keys = ["total", "restart", "imports", "build", "session start (restore)", "first step"]
    print(
        f"\n{args.megabytes:g} MiB checkpoint, SIGKILL to the next first step, median of "
        f"{args.trials} (each trial's total in brackets):\n"
    )
    print("| start | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    table: list[dict[str, object]] = []
    for name, rows in results.items():
        cells = [f"{statistics.median(r[k] for r in rows):.2f} s" for k in keys]
        totals = ", ".join(f"{r['total']:.2f}" for r in rows)
        cells[0] = f"**{cells[0]}** ({totals})"
        print(f"| {name} | " + " | ".join(cells) + " |")
        table.append(
            {"start": name}
            | {f"{k} s": statistics.median(r[k] for r in rows) for k in keys}
            | {"totals s": [r["total"] for r in rows]}
        )
    warm, cold = results["warm standby"], results["cold"]

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"\nstandby memory, waiting: RSS {median(warm, 'standby rss'):.0f} MiB, PSS "
        f"{median(warm, 'standby pss'):.0f} MiB; the trainer beside it: RSS "
        f"{median(warm, 'trainer rss'):.0f} MiB, PSS {median(warm, 'trainer pss'):.0f} MiB "
        f"(a cold trainer: RSS {median(cold, 'trainer rss'):.0f} MiB, PSS "
        f"{median(cold, 'trainer pss'):.0f} MiB)"
    )
    table.append(
        {
            "start": "warm standby memory, waiting (MiB)",
            "standby RSS MiB": statistics.median(r["standby rss"] for r in warm),
            "standby PSS MiB": statistics.median(r["standby pss"] for r in warm),
            "trainer RSS MiB": median(warm, "trainer rss"),
            "trainer PSS MiB": median(warm, "trainer pss"),
            "cold trainer RSS MiB": median(cold, "trainer rss"),
            "cold trainer PSS MiB": median(cold, "trainer pss"),
        }
    )
    write("restart_latency", table, megabytes=args.megabytes, trials=args.trials)


if __name__ == "__main__":
    main()
