"""A multi-worker job on this machine: steps/s for one and two workers, and SIGTERM to exit.

    python benchmarks/multiworker.py
    python benchmarks/multiworker.py --steps 5000

Runs examples/multiworker.py as real worker processes (TF_CONFIG on loopback ports):

- speed: the same training (global batch 32) with one worker, then two; each worker
  prints its steps/s over the whole run, restore and final save included;
- stop: a two-worker job gets SIGTERM on the non-chief mid-training; the time from the
  signal until both processes have exited, and the step both stopped at.

On one machine the workers share its cores, so two workers are not expected to be
faster: the figure shows what the all-reduce over gRPC and the coordination cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "multiworker.py"
RATE = re.compile(r"stopped at step (\d+) \((\w+)\); (\d+) steps in ([\d.]+) s = ([\d.]+) steps/s")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start(workers: int, logdir: str, *args: str) -> list[subprocess.Popen[str]]:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
    procs = []
    for index in range(workers):
        task = {"type": "worker", "index": index}
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": task}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--logdir", logdir, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        )
    return procs


def speed(workers: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        procs = start(workers, tmp, "--steps", str(steps), "--save-secs", "10")
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
        procs = start(2, tmp, "--steps", "100000000", "--save-secs", "1")
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
    args = parser.parse_args()
    one, two = speed(1, args.steps), speed(2, args.steps)
    print(f"| workers | steps/s ({args.steps} steps, global batch 32) |")
    print("|---|---|")
    print(f"| 1 | {one:.1f} |")
    print(f"| 2 | {two:.1f} ({two / one:.2f}x of one) |")
    seconds, stops = sigterm_to_exit(run_secs=12)
    print(f"\nSIGTERM to the non-chief -> both processes exited in {seconds:.2f} s; {stops}")


if __name__ == "__main__":
    main()
