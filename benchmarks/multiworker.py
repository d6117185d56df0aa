"""A multi-worker job on this machine: steps/s for one and two workers, and SIGTERM to exit.

    python benchmarks/multiworker.py
    python benchmarks/multiworker.py --steps 5000

Runs examples/multiworker.py as real worker processes (TF_CONFIG on loopback ports):

- speed: the same training (global batch 32) with one worker, then two. Each worker
  process runs a plain MWMS loop (no supervisor) for half the steps, then the same step
  under a supervisor with the services a real run has on (a checkpoint every 2 s,
  summaries every 1 s, the step-rate counter) for all the steps, then the plain loop
  again for half; each part is timed after a warm-up of its own (tracing), so the ratio
  is taken inside one process and start-up does not enter it (this script is that
  worker with --paired-worker);
- stop: a two-worker job gets SIGTERM on the non-chief mid-training; the time from the
  signal until both processes have exited, and the step both stopped at.

On one machine the workers share its cores, so two workers are not expected to be
faster: the figure shows what the all-reduce over gRPC and the coordination cost.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _results import write

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "multiworker.py"
sys.path.insert(0, str(ROOT))  # the benchmark drives the example and reuses its parts

from examples.multiworker import Training, local_tf_configs  # noqa: E402

RATE = re.compile(r"stopped at step (\d+) \((\w+)\); (\d+) steps in ([\d.]+) s = ([\d.]+) steps/s")


def start(workers: int, *command: str) -> list[subprocess.Popen[str]]:
    procs = []
    for config in local_tf_configs(workers):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": config}
        procs.append(
            subprocess.Popen(
                [sys.executable, *command],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        )
    return procs


WARMUP = 100  # steps before a part's clock starts: its tracing, the first collectives
PAIRED = re.compile(r"paired: plain ([\d.]+) steps/s, supervised ([\d.]+), plain ([\d.]+)")


def paired_worker(steps: int, logdir: str) -> None:
    """One worker: the plain MWMS loop, the same step supervised, the plain loop again."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import anyio
    import tensorflow as tf

    import asupervisor as asv

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    training = Training(tf, strategy, 32)
    batches = iter(training.data(0))

    def plain(count: int) -> float:
        for _ in range(WARMUP):
            training.train_step(*next(batches))
        began = time.monotonic()
        for _ in range(count):
            training.train_step(*next(batches))
        return count / (time.monotonic() - began)

    async def supervised() -> float:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"model": training.model, "optimizer": training.optimizer},
            strategy=strategy,
            is_chief=None,
            save_model_secs=2.0,
            save_summaries_secs=1.0,
            summary_fn=training.summaries,
        )
        async with sv.session() as sess:
            await sess.train(training.train_step, batches, max_steps=WARMUP)
            began = time.monotonic()
            await sess.train(training.train_step, batches, max_steps=steps)
            rate = steps / (time.monotonic() - began)
            sess.request_stop()
        return rate

    before = plain(steps // 2)
    ours = anyio.run(supervised)
    after = plain(steps // 2)
    print(f"paired: plain {before:.1f} steps/s, supervised {ours:.1f}, plain {after:.1f}")


def preemption_worker(logdir: str) -> None:
    """One worker of the alternative a TF user picks: a plain MWMS loop under TF's own
    ``PreemptionCheckpointHandler``, told of SIGTERM the way TF documents for platforms
    it does not know (a ``termination_watcher_fn``, which TF polls every second)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    training = Training(tf, strategy, 32)
    signalled = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: signalled.set())
    checkpoint = tf.train.Checkpoint(model=training.model, optimizer=training.optimizer)
    steps = 0

    def exit_fn() -> None:
        # TF calls this once the checkpoint is written: the line marks that moment.
        print(f"stopped at step {steps} (preempted); {steps} steps in 0 s = 0 steps/s", flush=True)
        sys.exit(0)

    config = tf.distribute.experimental.TerminationConfig(
        termination_watcher_fn=signalled.is_set, exit_fn=exit_fn, grace_period=0
    )
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, logdir, termination_config=config
    )
    batches = iter(training.data(0))
    print("[plain] starting at step 0", flush=True)
    while True:
        handler.run(training.train_step, *next(batches))
        steps += 1


def speed(workers: int, steps: int) -> tuple[float, float]:
    """One job: the plain loop's steps/s (mean of before and after) and the supervised
    one's, each the slowest worker's (the job goes as fast as its slowest worker)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [__file__, "--paired-worker", "--steps", str(steps), "--logdir", tmp]
        procs = start(workers, *command)
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    plains, ours = [], []
    for out in outputs:
        found = PAIRED.search(out)
        if found is None:
            raise SystemExit(f"a worker did not finish:\n{out[-2000:]}")
        plains.append((float(found[1]) + float(found[3])) / 2)
        ours.append(float(found[2]))
    return min(plains), min(ours)


def sigterm_to_exit(run_secs: float, command: list[str]) -> tuple[float, float, str]:
    """SIGTERM to the non-chief once both workers train: seconds until the last worker
    wrote its final checkpoint (the line saying so reached us), and until both exited."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = start(2, *command, "--logdir", tmp)
        outputs: list[list[tuple[float, str]]] = [[] for _ in procs]

        def read(proc: subprocess.Popen[str], lines: list[tuple[float, str]]) -> None:
            assert proc.stdout is not None
            lines.extend((time.monotonic(), line) for line in proc.stdout)

        readers = [
            threading.Thread(target=read, args=(p, o), daemon=True)
            for p, o in zip(procs, outputs, strict=True)
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 300
        while sum(any("starting at step" in line for _, line in o) for o in outputs) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("the workers did not start:\n" + text(outputs[0]))
            time.sleep(0.1)
        time.sleep(run_secs)
        procs[1].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for p in procs:
            p.wait(timeout=120)
        seconds = time.monotonic() - sent
        for reader in readers:
            reader.join()
    stops = [RATE.search(text(o)) for o in outputs]
    if not all(stops):
        raise SystemExit("a worker did not stop cleanly:\n" + text(outputs[0]))
    saved = max(
        max(
            at
            for at, line in o
            if at > sent and ("checkpoint.saved" in line or "preempted" in line)
        )
        for o in outputs
    )
    described = ", ".join(f"worker {i}: step {m[1]} ({m[2]})" for i, m in enumerate(stops) if m)
    return saved - sent, seconds, described


def text(lines: list[tuple[float, str]]) -> str:
    return "".join(line for _, line in lines)[-2000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="(default: %(default)s)")
    parser.add_argument("--trials", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("speed", "stop"),
        default=["speed", "stop"],
        help="what to measure (default: both)",
    )
    parser.add_argument("--paired-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preemption-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.preemption_worker:
        preemption_worker(args.logdir)
        return
    if args.paired_worker:
        paired_worker(args.steps, args.logdir)
        return
    table: list[dict[str, object]] = []
    if "speed" in args.parts:
        table += speeds(args.steps, args.trials)
    if "stop" in args.parts:
        table += stops(args.trials)
    write("multiworker", table, steps=args.steps, trials=args.trials)


def speeds(steps: int, trials: int) -> list[dict[str, object]]:
    table: list[dict[str, object]] = []
    print(
        "| workers | plain MWMS loop | supervised (sess.train, services on) "
        "| step time, supervised/plain (each run) |"
    )
    print("|---|---|---|---|")
    for workers in (1, 2):
        runs = [speed(workers, steps) for _ in range(trials)]
        ratios = [plain / ours for plain, ours in runs]
        each = ", ".join(f"{r:.2f}" for r in ratios)
        plain = statistics.median(p for p, _ in runs)
        ours = statistics.median(o for _, o in runs)
        print(
            f"| {workers} | {plain:.1f} steps/s | {ours:.1f} steps/s "
            f"| **{statistics.median(ratios):.2f}x** ({each}) |",
            flush=True,
        )
        table.append(
            {
                "part": f"speed, {workers} worker(s)",
                "plain MWMS loop steps/s": plain,
                "supervised steps/s": ours,
                "step time, supervised / plain": statistics.median(ratios),
                "each run": ratios,
            }
        )
    print(
        f"(median of {trials} jobs; in each worker process {steps} supervised steps "
        f"between two plain halves, each part after a {WARMUP}-step warm-up; "
        "global batch 32)"
    )
    return table


def stops(trials: int) -> list[dict[str, object]]:
    table: list[dict[str, object]] = []
    ours = [str(EXAMPLE), "--steps", "100000000", "--save-secs", "1"]
    theirs = [__file__, "--preemption-worker"]
    print(
        "\n| SIGTERM to the non-chief | final checkpoints written (s) | both processes "
        "exited (s) | where they stopped (last trial) |"
    )
    print("|---|---|---|---|")
    for name, command in (("asupervisor", ours), ("PreemptionCheckpointHandler", theirs)):
        runs = [sigterm_to_exit(3.0, command) for _ in range(trials)]
        saved = ", ".join(f"{s:.2f}" for s, _, _ in runs)
        exited = ", ".join(f"{e:.2f}" for _, e, _ in runs)
        print(f"| {name} | {saved} | {exited} | {runs[-1][2]} |", flush=True)
        table.append(
            {
                "part": f"SIGTERM to the non-chief: {name}",
                "final checkpoints written s": [s for s, _, _ in runs],
                "both processes exited s": [e for _, e, _ in runs],
                "where they stopped (last trial)": runs[-1][2],
            }
        )
    return table


if __name__ == "__main__":
    main()
