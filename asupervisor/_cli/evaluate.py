"""``asupervisor evaluate LOGDIR``: the sidecar evaluator as a command.

The user's code says what to evaluate: a function (in a script, or in an importable
module) that builds the model and returns ``(checkpoint, eval_fn)``, as the trainer would
give its Supervisor. TensorFlow is imported only once the arguments are read, so
``--help`` is instant. The command is an application: it configures logging (one line
per event on stderr) and handles SIGTERM and Ctrl-C, which the library never does.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

from .._evaluate.choice import BACKLOG
from .quiet import quiet_tensorflow

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

DESCRIPTION = """\
Evaluate every committed checkpoint of a training run once, in this process, beside the
trainer: training is not held while evaluation runs. Each checkpoint is restored (only
the objects you give), your eval function runs, and its metrics go to TensorBoard as
eval/<name> at the checkpoint's step (LOGDIR/eval) and to LOGDIR/eval/.asupervisor.evaluated.
Run it again and it goes on where it stopped."""

EPILOG = """\
the factory (a script's make_evaluator, or --module pkg.mod:function), called with no
arguments, returns (checkpoint, eval_fn): the checkpoint object or mapping the trainer
gives its Supervisor (the model alone is enough), built, and a function that returns a
mapping of metric name to number:

  # evaluate_digits.py
  import keras, tensorflow as tf
  def make_evaluator():
      model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      x, y = load_test_set()
      def eval_fn():
          logits = model(x, training=False)
          return {"accuracy": keras.metrics.SparseCategoricalAccuracy()(y, logits)}
      return {"model": model}, eval_fn

examples:
  asupervisor evaluate runs/digits --script evaluate_digits.py --until-step 3000
  asupervisor evaluate runs/digits --module myproject.evaluation:make_evaluator --idle-secs 600
  asupervisor evaluate gs://bucket/run --script evaluate_digits.py --latest-only

It ends when a checkpoint at or past --until-step is evaluated and none is left, or when
no new checkpoint has been committed for --idle-secs; without either, when stopped.
SIGTERM or Ctrl-C stops it after the evaluation in flight (recorded); a second one at once.

exit status: 0 done (--until-step, --idle-secs), 42 stopped by a signal (run it again to
go on), 1 an error, 78 a configuration error (a factory that fails, a checkpoint that does
not fit the model), 130 stopped at once by a second signal, 2 bad arguments.
"""


def add_parser(commands: Any) -> None:
    """The ``evaluate`` subcommand, on ``asupervisor``'s subparsers."""
    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate every committed checkpoint of a run once, beside the trainer",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    evaluate.add_argument("logdir", metavar="LOGDIR", help="the trainer's logdir")
    source = evaluate.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--script",
        metavar="PATH[:FUNCTION]",
        help="a Python file defining the factory (default name: make_evaluator)",
    )
    source.add_argument(
        "--module", metavar="MODULE:FUNCTION", help="an importable module and its factory"
    )
    evaluate.add_argument(
        "--until-step",
        type=int,
        metavar="N",
        help="end once a checkpoint at step N or later is evaluated (the run's last step)",
    )
    evaluate.add_argument(
        "--idle-secs",
        type=float,
        metavar="S",
        help="end once nothing is left and no checkpoint has been committed for S seconds",
    )
    evaluate.add_argument(
        "--poll-secs",
        type=float,
        default=10.0,
        metavar="S",
        help="how often to look for new checkpoints (default: 10)",
    )
    evaluate.add_argument(
        "--latest-only",
        action="store_true",
        help="evaluate only the newest checkpoint at each look, skipping older ones",
    )
    evaluate.add_argument(
        "--name",
        default="evaluator",
        help="the name of the evaluator's lease in LOGDIR (default: evaluator)",
    )
    evaluate.add_argument(
        "--backlog",
        type=int,
        default=BACKLOG,
        metavar="N",
        help="how many commits not evaluated yet the trainer keeps on disk for it; past "
        f"that, the ones swept are recorded as skipped (default: {BACKLOG})",
    )


def load_factory(script: str | None, module: str | None) -> Callable[[], Any]:
    """The user's factory, from ``path.py[:function]`` or ``package.module:function``."""
    if script is not None:
        path, _, function = script.partition(":") if script.count(":") == 1 else (script, "", "")
        namespace = runpy.run_path(path, run_name="__asupervisor_evaluate__")
        name = function or "make_evaluator"
        factory = namespace.get(name)
        where = path
    else:
        assert module is not None
        module_name, _, name = module.partition(":")
        if not name:
            raise ValueError(f"--module {module!r}: give it as MODULE:FUNCTION")
        factory = getattr(importlib.import_module(module_name), name, None)
        where = module_name
    if not callable(factory):
        raise ValueError(f"{where} defines no function {name!r}")
    return factory  # type: ignore[no-any-return]


def main(args: argparse.Namespace) -> int:
    """Run the evaluator the arguments describe; the exit status (see the epilog)."""
    import logging

    import anyio

    from .. import _exit

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    quiet_tensorflow()
    stopped_by: list[str] = []
    try:
        checkpoint, eval_fn = _made(load_factory(args.script, args.module)())
        from .._evaluate.evaluator import Evaluator

        evaluator = Evaluator(
            args.logdir,
            checkpoint=checkpoint,
            eval_fn=eval_fn,
            poll_secs=args.poll_secs,
            latest_only=args.latest_only,
            name=args.name,
            backlog=args.backlog,
        )
        anyio.run(_run, evaluator, args, stopped_by)
    except (KeyboardInterrupt, Exception) as exc:
        error = _leaf(exc)
        if not isinstance(error, KeyboardInterrupt):
            print(f"asupervisor evaluate: error: {type(error).__name__}: {error}", file=sys.stderr)
        return _exit.status_of(error)
    if len(stopped_by) > 1:
        # Stop now: the evaluation in flight runs in a worker thread that the interpreter's
        # exit would wait for. Nothing is lost: the files are written whole, and that
        # evaluation was not recorded, so the next run does it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit.status_of(KeyboardInterrupt()))
    return _exit.status_of(None, signalled=stopped_by[0] if stopped_by else None)


def _leaf(error: BaseException) -> BaseException:
    """The error itself, out of the task group's exception group around it."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _made(made: Any) -> tuple[Any, Callable[[], Any]]:
    if not isinstance(made, tuple) or len(made) != 2:
        raise ValueError(f"the factory must return (checkpoint, eval_fn), not {made!r}")
    return made[0], made[1]


async def _run(evaluator: Any, args: argparse.Namespace, stopped_by: list[str]) -> None:
    """The evaluator, and a task that turns the first signal into a stop after the
    evaluation in flight and a second one into a stop at once."""
    import signal

    import anyio

    from .._log import log

    async with anyio.create_task_group() as tasks:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for received in signals:
                    stopped_by.append(signal.Signals(received).name)
                    if len(stopped_by) == 1:
                        log.warning(
                            "signal.received",
                            signal=stopped_by[-1],
                            action="stop after the evaluation in flight",
                        )
                        evaluator.stop()
                    else:
                        log.warning("signal.received", signal=stopped_by[-1], action="stop now")
                        tasks.cancel_scope.cancel()

        tasks.start_soon(on_signals)
        await evaluator.run(until_step=args.until_step, idle_secs=args.idle_secs)
        tasks.cancel_scope.cancel()
