"""A run interrupted N times against the same run left alone: what differs at the end.

    python benchmarks/resume_equivalence.py [--interruptions 3] [--seed 0] [--workers]

The run is tests/faults/deterministic.py (seeded, op determinism, Dropout, a shuffled
``tf.data`` pipeline that is a function of the epoch, Adam; 4 epochs of 20 batches):
``sess.train(step, data, epochs=)`` with a hook that keeps a state, and ``sess.fit`` with
validation data, EarlyStopping, ReduceLROnPlateau and ModelCheckpoint(save_best_only).
Each is run once left alone, then, in a fresh logdir, interrupted ``--interruptions``
times by SIGKILL (or by SIGTERM) after a random number of batches (1 to 30) since its
start, started again each time, and run to its end. Compared: the largest difference of
any weight, whether every other value of the final state is bitwise the same (optimizer
iterations, learning rate, the Dropout generator's state, the hook's and the callbacks'
kept state), and the batches trained (each example carries its id): batches in another
place, examples trained more (repeated) or fewer (skipped) times in an epoch.

``--workers`` runs the custom loop as a two-worker ``MultiWorkerMirroredStrategy`` job on
loopback instead (the data auto-sharded by ``experimental_distribute_dataset``): each
interruption goes to one worker, chosen at random (SIGKILL ends the other with a lost
collective; SIGTERM stops both at an agreed step), and the whole job is started again.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import write

from tests.faults.deterministic import batch_differences, compare, trained

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "faults" / "deterministic.py"


def command(directory: str, mode: str) -> list[str]:
    args = [sys.executable, str(PROGRAM), os.path.join(directory, "run"), "--mode", mode]
    args += ["--record", os.path.join(directory, "trained")]
    return [*args, "--final", os.path.join(directory, "final.npz")]


def run_job(
    directory: str,
    mode: str,
    workers: int,
    interrupt: tuple[int, int] | None,
    rng: random.Random,
) -> list[int]:
    """The run's processes (one, or the workers of a job on loopback); with ``interrupt``
    = (signal, batches), that signal to one of them once it has trained that many
    batches. Their exit statuses."""
    from examples.multiworker import local_tf_configs

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    configs = local_tf_configs(workers) if workers > 1 else [None]
    scratch = tempfile.mkdtemp(prefix="asv-scratch-")  # a non-chief's scratch saves
    procs, errors = [], []
    for config in configs:
        extra = {"TF_CONFIG": config, "TMPDIR": scratch} if config else {}
        proc = subprocess.Popen(
            command(directory, mode),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, **extra},
        )
        lines: list[str] = []
        threading.Thread(target=lambda p=proc, ls=lines: ls.extend(p.stderr), daemon=True).start()
        procs.append(proc)
        errors.append(lines)
    target = procs[rng.randrange(len(procs))]
    readers = []
    for proc in procs:
        watch = interrupt if proc is target else None
        reader = threading.Thread(target=follow, args=(proc, watch), daemon=True)
        reader.start()
        readers.append(reader)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(600))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    for code, lines in zip(codes, errors, strict=True):
        if code not in (0, 42, 1, -signal.SIGKILL, -signal.SIGTERM):  # -SIGTERM: after the session
            raise RuntimeError(f"exit {code}:\n{''.join(lines)[-3000:]}")
        if code == 1 and (workers == 1 or interrupt is None or interrupt[0] != signal.SIGKILL):
            raise RuntimeError(f"exit 1:\n{''.join(lines)[-3000:]}")
    return codes


def follow(proc: subprocess.Popen[str], interrupt: tuple[int, int] | None) -> None:
    """Read a process's progress; send the signal once it has trained enough batches."""
    assert proc.stdout is not None
    batches = 0
    for line in proc.stdout:
        if line.startswith("step ") and interrupt is not None:
            batches += 1
            if batches == interrupt[1]:
                proc.send_signal(interrupt[0])
                interrupt = None


def outcome(directory: str) -> tuple[dict[str, Any], list[tuple[int, tuple[int, ...]]]]:
    import numpy as np

    return dict(np.load(os.path.join(directory, "final.npz"))), trained(
        os.path.join(directory, "trained")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interruptions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", action="store_true", help="a two-worker job")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workers = 2 if args.workers else 1
    rows = []
    print("| run | signal | interrupted after (batches) | max weight difference | "
          "rest of the state | batches moved | examples repeated | examples skipped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("train",) if args.workers else ("train", "fit"):
        alone = tempfile.mkdtemp(prefix="asv-alone-")
        run_job(alone, mode, workers, None, rng)
        reference, reference_batches = outcome(alone)
        for sig in (signal.SIGKILL, signal.SIGTERM):
            directory = tempfile.mkdtemp(prefix="asv-cut-")
            cuts = [rng.randint(1, 30) for _ in range(args.interruptions)]
            for cut in cuts:
                if 0 in run_job(directory, mode, workers, (sig, cut), rng):
                    break  # it had trained to its end
            run_job(directory, mode, workers, None, rng)
            final, batches = outcome(directory)
            differences = compare(final, reference)
            moved = batch_differences(batches, reference_batches)
            name = "sess.train(epochs=)" if mode == "train" else "sess.fit + callbacks"
            row = {
                "run": name + (", 2 workers" if args.workers else ""),
                "signal": signal.Signals(sig).name,
                "interrupted after (batches)": cuts,
                "max weight difference": differences["max_weight_difference"],
                "rest of the state": "bitwise equal"
                if not differences["unequal"]
                else "differs: " + ", ".join(differences["unequal"]),
                "batches moved": moved["batches_moved"],
                "examples repeated": moved["examples_repeated"],
                "examples skipped": moved["examples_skipped"],
            }
            rows.append(row)
            print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)
    name = "resume_equivalence_workers" if args.workers else "resume_equivalence"
    write(name, rows, interruptions=args.interruptions, seed=args.seed)


if __name__ == "__main__":
    main()
