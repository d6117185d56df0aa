"""What a start forked from the warm standby costs to end, with the imports frozen or not.

    python benchmarks/fork_exit.py
    python benchmarks/fork_exit.py --trials 5

This process imports what the standby imports (TensorFlow, Keras, asupervisor), then forks
starts that each create a variable, run one op, and end as a script ends (``sys.exit``:
the interpreter's own shutdown, its last collections, the modules torn down). Each start's
CPU time (user and system, from ``wait4``) and its minor page faults (pages it copied or
touched first) are read when it is reaped, in three arms taken in turn: the imports left
to the collector, as a plain fork leaves them; after a ``gc.collect()`` only; and after
``gc.collect(); gc.freeze()``, as the standby does before it forks
(``asupervisor/_run/standby.py``; unfrozen again after each such fork).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

from _results import write


def start() -> None:
    """A start's smallest life: one variable, one op, a normal end."""
    import tensorflow as tf

    v = tf.Variable(0.0)
    v.assign_add(1.0)
    sys.stdout.flush()


ARMS = {
    "left to the collector": "imports left to the collector",
    "collected": "imports collected, not frozen",
    "frozen": "imports frozen (the standby)",
}


def trial(arm: str) -> tuple[float, int]:
    """One forked start, ended as a script ends: (its CPU seconds, its minor faults)."""
    if arm != "left to the collector":
        gc.collect()
    if arm == "frozen":
        gc.freeze()
    pid = os.fork()
    if arm == "frozen" and pid != 0:
        gc.unfreeze()  # the next arm forks from a process as it was
    if pid == 0:
        try:
            start()
        finally:
            sys.exit(0)  # the interpreter's shutdown, as a script's end
    _, status, usage = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    import asupervisor  # noqa: F401

    results: dict[str, list[tuple[float, int]]] = {name: [] for name in ARMS.values()}
    for _ in range(args.trials):  # the arms in turn: a drift of the machine hits each alike
        for arm, name in ARMS.items():
            results[name].append(trial(arm))
    plain = statistics.median(cpu for cpu, _ in results["imports left to the collector"])
    rows = []
    print(f"\na start forked after the imports, ended by sys.exit (median of {args.trials}):\n")
    print("| imports | CPU s | minor faults | CPU vs frozen |")
    print("|---|---|---|---|")
    frozen = statistics.median(cpu for cpu, _ in results["imports frozen (the standby)"])
    for name, trials in results.items():
        cpu = statistics.median(c for c, _ in trials)
        faults = statistics.median(f for _, f in trials)
        print(f"| {name} | {cpu:.2f} | {faults:.0f} | {cpu / frozen:.1f}x |")
        rows.append(
            {
                "imports": name,
                "CPU s": cpu,
                "minor faults": faults,
                "CPU vs frozen": cpu / frozen,
                "trials CPU s": [c for c, _ in trials],
            }
        )
    print(f"\nfreezing the imports saves {plain - frozen:.2f} s of CPU at each start's end")
    write("fork_exit", rows, trials=args.trials)


if __name__ == "__main__":
    main()
