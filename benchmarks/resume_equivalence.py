"""A run interrupted N times against the same run left alone: what differs at the end.

    python benchmarks/resume_equivalence.py [--interruptions 3] [--seed 0]

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


def run(directory: str, mode: str, interrupt: tuple[int, int] | None = None) -> int:
    """One process of the run in ``directory``; with ``interrupt`` = (signal, batches),
    that signal once it has trained that many batches. Its exit status."""
    command = [sys.executable, str(PROGRAM), os.path.join(directory, "run"), "--mode", mode]
    command += ["--record", os.path.join(directory, "trained")]
    command += ["--final", os.path.join(directory, "final.npz")]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(proc.stderr or []), daemon=True).start()
    assert proc.stdout is not None
    batches = 0
    for line in proc.stdout:
        if line.startswith("step ") and interrupt is not None:
            batches += 1
            if batches == interrupt[1]:
                proc.send_signal(interrupt[0])
                break
    for _ in proc.stdout:
        pass
    code = proc.wait(600)
    if code not in (0, 42, -signal.SIGKILL):
        raise RuntimeError(f"exit {code}:\n{''.join(errors)[-3000:]}")
    return code


def outcome(directory: str) -> tuple[dict[str, Any], list[tuple[int, tuple[int, ...]]]]:
    import numpy as np

    return dict(np.load(os.path.join(directory, "final.npz"))), trained(
        os.path.join(directory, "trained")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interruptions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    print("| run | signal | interrupted after (batches) | max weight difference | "
          "rest of the state | batches moved | examples repeated | examples skipped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("train", "fit"):
        alone = tempfile.mkdtemp(prefix="asv-alone-")
        run(alone, mode)
        reference, reference_batches = outcome(alone)
        for sig in (signal.SIGKILL, signal.SIGTERM):
            directory = tempfile.mkdtemp(prefix="asv-cut-")
            cuts = [rng.randint(1, 30) for _ in range(args.interruptions)]
            for cut in cuts:
                if run(directory, mode, (sig, cut)) == 0:
                    break  # it had trained to its end
            run(directory, mode)
            final, batches = outcome(directory)
            differences = compare(final, reference)
            moved = batch_differences(batches, reference_batches)
            row = {
                "run": "sess.train(epochs=)" if mode == "train" else "sess.fit + callbacks",
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
    write("resume_equivalence", rows, interruptions=args.interruptions, seed=args.seed)


if __name__ == "__main__":
    main()
