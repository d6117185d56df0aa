"""A multi-worker job on this machine: steps/s for one and two workers, and SIGTERM to exit.

    python benchmarks/multiworker.py
    python benchmarks/multiworker.py --steps 5000

Runs examples/multiworker.py as real worker processes (TF_CONFIG on loopback ports):

- speed: the same training (global batch 32) with one worker, then two; each worker
  prints its steps/s over the whole run (first step's tracing and final save included),
  beside the same step run by a plain loop in the same kind of worker processes
  (MWMS, no supervisor; this script is that worker with --plain-worker);
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
import time
from pathlib import Path

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


def plain_worker(steps: int) -> None:
    """One worker of a plain MWMS loop over the example's own step; no supervisor."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    training = Training(tf, strategy, 32)
    batches = iter(training.data(0))
    began = time.monotonic()
    for _ in range(steps):
        training.train_step(*next(batches))
    seconds = time.monotonic() - began
    print(
        f"stopped at step {steps} (plain); {steps} steps in {seconds:.1f} s = "
        f"{steps / seconds:.1f} steps/s",
        flush=True,
    )


def speed(workers: int, steps: int, plain: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        if plain:
            command = [__file__, "--plain-worker", "--steps", str(steps)]
        else:
            command = [str(EXAMPLE), "--logdir", tmp, "--steps", str(steps), "--save-secs", "10"]
        procs = start(workers, *command)
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    rates = []
    for out in outputs:
        found = RATE.search(out)
        if found is None:
            raise SystemExit(f"a worker did not finish:\n{out[-2000:]}")
        rates.append(float(found[5]))
    return min(rates)  # the job goes as fast as its slowest worker


def sigterm_to_exit(run_secs: float) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [str(EXAMPLE), "--logdir", tmp, "--steps", "100000000", "--save-secs", "1"]
        procs = start(2, *command)
        time.sleep(run_secs)
        procs[1].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        seconds = time.monotonic() - sent
    stops = [RATE.search(out) for out in outputs]
    if not all(stops):
        raise SystemExit("a worker did not stop cleanly:\n" + outputs[0][-2000:])
    described = ", ".join(f"worker {i}: step {m[1]} ({m[2]})" for i, m in enumerate(stops) if m)
    return seconds, described


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="(default: %(default)s)")
    parser.add_argument("--trials", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        plain_worker(args.steps)
        return
    print("| workers | plain MWMS loop | supervised (sess.train) | step time, supervised/plain |")
    print("|---|---|---|---|")
    for workers in (1, 2):
        plain = statistics.median(speed(workers, args.steps, True) for _ in range(args.trials))
        ours = statistics.median(speed(workers, args.steps, False) for _ in range(args.trials))
        print(f"| {workers} | {plain:.1f} steps/s | {ours:.1f} steps/s | {plain / ours:.2f}x |")
    print(f"(median of {args.trials} runs of {args.steps} steps, global batch 32)")
    for _ in range(args.trials):
        seconds, stops = sigterm_to_exit(run_secs=12)
        print(f"SIGTERM to the non-chief -> both processes exited in {seconds:.2f} s; {stops}")


if __name__ == "__main__":
    main()
