"""A small supervised training run for fault tests: kill it, signal it, break it.

    python tests/faults/trainer.py LOGDIR [--save-steps N] [--async] [--fault NAME]

It prints one line per event, flushed at once, so that a harness can follow it:
``restored STEP``, ``step STEP`` (after each completed step: after a rollback, the step
it went back to), ``saved STEP`` (from an after_save hook: the files are on disk),
``nan STEP`` (the step about to run will have a NaN loss) and ``stopped STEP REASON``.
With ``--commands`` it reads lines on stdin: ``nan`` (the next step's loss is NaN) and
``stop`` (a clean stop, as a user's own).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import anyio
import structlog
import tensorflow as tf

import asupervisor as asv

FAULTS = ("none", "service", "hook", "hang", "events-deleted", "full-disk")


class Pair(tf.Module):
    """``a`` and ``b`` advance one after the other: a torn checkpoint would show a != b."""

    def __init__(self, megabytes: float) -> None:
        super().__init__()
        self.a = tf.Variable(0.0)
        self.b = tf.Variable(0.0)
        # Bulk, so that a save takes long enough for kills to land inside it.
        self.bulk = tf.Variable(tf.zeros([max(1, int(megabytes * 262144))]))

    def step(self, pause: float, nan: bool = False) -> dict[str, tf.Tensor]:
        self.a.assign_add(1.0)
        time.sleep(pause)
        self.b.assign_add(1.0)
        return {"loss": tf.constant(float("nan")) if nan else self.a.read_value()}


class Commands:
    """What the harness asks for on stdin, read in a thread of its own."""

    def __init__(self) -> None:
        self._asked: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            with self._lock:
                self._asked.add(line.strip())

    def take(self, command: str) -> bool:
        """Whether ``command`` was asked for since the last time it was taken."""
        with self._lock:
            asked = command in self._asked
            self._asked.discard(command)
            return asked


class Report(asv.Hook):
    def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
        print(f"saved {step}", flush=True)
        return False


class FailingHook(asv.Hook):
    def before_run(self, ctx: asv.RunContext) -> None:
        if ctx.step == 12:
            raise RuntimeError("hook failed at step 12")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir")
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--async", dest="async_checkpoint", action="store_true")
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--pause", type=float, default=0.01, help="seconds between a and b")
    parser.add_argument(
        "--long-step", type=float, default=0.0, help="step 2 takes this long (a step in flight)"
    )
    parser.add_argument("--max-steps", type=int, default=10**9)
    parser.add_argument("--grace", type=float, default=1.0, help="stop_grace_secs")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument(
        "--wait-for-go", action="store_true", help='print "ready", start on a "go" line'
    )
    parser.add_argument(
        "--commands", action="store_true", help='read "nan" and "stop" lines on stdin'
    )
    parser.add_argument(
        "--rollback", type=int, default=0, help="roll back a NaN loss, at most N times (0: off)"
    )
    parser.add_argument("--local-dir", default=None, help="a local tier there (LocalTier)")
    parser.add_argument("--local-steps", type=int, default=2, help="the local tier's save_steps")
    parser.add_argument("--summaries-secs", type=float, default=0.2)
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    pair = Pair(args.megabytes)
    hooks: list[asv.Hook] = [Report()]
    if args.fault == "hook":
        hooks.append(FailingHook())
    sv = asv.Supervisor(
        args.logdir,
        checkpoint={"pair": pair},
        save_model_secs=3600,
        save_model_steps=args.save_steps,
        max_to_keep=3,
        async_checkpoint=args.async_checkpoint,
        save_summaries_secs=args.summaries_secs,
        hooks=hooks,
        stop_grace_secs=args.grace,
        step_timeout_secs=1.0 if args.fault == "hang" else None,
        on_divergence=asv.Rollback(max_rollbacks=args.rollback) if args.rollback else None,
        local_tier=None
        if args.local_dir is None
        else asv.LocalTier(args.local_dir, save_secs=None, save_steps=args.local_steps),
    )
    if args.fault == "service":

        @sv.service
        async def broken(sess: asv.ManagedSession) -> None:
            await anyio.sleep(0.3)
            raise ConnectionError("the metrics endpoint went away")

    if args.wait_for_go:  # TensorFlow imported, the model built: only the session is left
        print("ready", flush=True)
        sys.stdin.readline()
    commands = Commands() if args.commands else None
    async with sv.session() as sess:
        print(f"restored {sess.restore_report.step}", flush=True)
        print(f"tier {sess.restore_report.tier}", flush=True)
        while not sess.should_stop() and sess.global_step < args.max_steps:
            if args.fault == "hang" and sess.global_step == 10:
                await sess.run(time.sleep, 30)
            if args.fault == "full-disk" and sess.global_step == 12:
                # Writes past 64 KiB now fail (EFBIG), as writes to a full disk fail.
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
            if args.fault == "events-deleted" and sess.global_step == 10:
                for name in os.listdir(args.logdir):
                    if name.startswith("events.out"):
                        os.remove(os.path.join(args.logdir, name))
            long_step = args.long_step if sess.global_step == 1 else 0.0
            nan = commands is not None and commands.take("nan")
            if nan:
                print(f"nan {sess.global_step + 1}", flush=True)
            await sess.run(pair.step, args.pause + long_step, nan)
            print(f"step {sess.global_step}", flush=True)
            if commands is not None and commands.take("stop"):
                sess.request_stop(reason="told")
    print(f"stopped {sess.global_step} {sess.stop_reason}", flush=True)


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    logging.getLogger("asupervisor").setLevel(logging.DEBUG)  # every event, for the harness
    sys.exit(asv.run(main, parse()))  # the exit status says how it ended (preempted: 42)
