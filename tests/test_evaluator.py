"""The sidecar evaluator (issue 23): every committed checkpoint evaluated exactly once,
across its own restart and while the chief's retention sweeps; a lease on the one it
evaluates; never an uncommitted one; ``eval/*`` events TensorBoard reads; the command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._evaluate import evaluator as _evaluator
from asupervisor._logdir import leases as _leases
from asupervisor._logdir.history import read_history
from asupervisor._logdir.records import read_results
from asupervisor._logdir.store import Store
from asupervisor.cli import main
from tests import forked
from tests.conftest import Pair, named, pair_supervisor

LEASE = _leases.PREFIX + "evaluator"


def evaluator(logdir: str, **kwargs: Any) -> tuple[asv.Evaluator, Pair]:
    """An evaluator over a Pair of its own, whose metrics are the pair's values: each
    says which step's state was restored."""
    pair = kwargs.pop("checkpoint", {"pair": Pair()})["pair"]
    kwargs.setdefault("poll_secs", 0.02)
    eval_fn = kwargs.pop("eval_fn", None) or (lambda: {"a": pair.a, "b": pair.b.numpy()})
    return asv.Evaluator(logdir, checkpoint={"pair": pair}, eval_fn=eval_fn, **kwargs), pair


def tensorboard_points(logdir: str, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``tag`` in ``logdir/eval`` as TensorBoard reads them."""
    from tensorboard.backend.event_processing import plugin_event_accumulator

    accumulator = plugin_event_accumulator.EventAccumulator(f"{logdir}/eval")
    accumulator.Reload()
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]


def results_file(logdir: str) -> dict[str, Any]:
    return dict(json.loads((Path(logdir) / "eval" / ".asupervisor.evaluated").read_text()))


async def train(logdir: str, steps: int, **kwargs: Any) -> None:
    pair = Pair()
    async with pair_supervisor(logdir, pair, **kwargs).session() as sess:
        for _ in range(steps):
            await sess.run(pair.step)


@pytest.mark.asyncio
async def test_every_committed_checkpoint_once_across_a_restart_while_retention_sweeps(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """A chief that saves at every step and keeps one checkpoint; an evaluator slower than
    the saves, stopped after three evaluations and started again (new objects, new
    Evaluator) until the chief's last step."""
    last_step = 40
    first_done = anyio.Event()
    pair, count, raced = Pair(), [0], []

    def slow(pair: Pair) -> dict[str, Any]:
        time.sleep(0.15)  # longer than the chief's steps and saves: the sweep races it
        step = int(pair.a.numpy())
        committed = [c.name for c in read_history(Store(logdir)).committed()]
        if committed[-1:] != [f"model.ckpt-{step}"]:  # newer ones came while it was read:
            assert f"model.ckpt-{step}" in committed  # beyond max_to_keep, its lease keeps it
            raced.append(step)
        return {"a": pair.a, "b": pair.b.numpy()}

    def first_fn() -> dict[str, Any]:
        count[0] += 1
        if count[0] == 3:
            first.stop()  # from the evaluation's thread
        return slow(pair)

    first = asv.Evaluator(logdir, checkpoint={"pair": pair}, eval_fn=first_fn, poll_secs=0.02)

    async def chief() -> None:
        pair = Pair()
        sv = pair_supervisor(logdir, pair, max_to_keep=1, save_model_steps=1)
        async with sv.session() as sess:
            for _ in range(last_step):
                await sess.run(pair.step)
                await anyio.sleep(0.01)
                if sess.global_step == 26:  # the restart comes in the middle of the run
                    while count[0] < 1:
                        await anyio.sleep(0.01)
                    first.stop()
                    await first_done.wait()

    evaluations: list[list[asv.Evaluation]] = []

    async def evaluators() -> None:
        evaluations.append(await first.run())
        first_done.set()
        other = Pair()
        second, _ = evaluator(logdir, checkpoint={"pair": other}, eval_fn=lambda: slow(other))
        evaluations.append(await second.run(until_step=last_step))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(chief)
            tasks.start_soon(evaluators)

    before, after = evaluations
    assert 1 <= len(before) <= 3 and len(after) >= 2
    names = [e.checkpoint for e in before + after]
    assert len(names) == len(set(names))  # none twice, across the restart
    for e in before + after:  # the state of the checkpoint's own step was restored
        assert e.metrics == {"a": float(e.step), "b": float(e.step)}
        assert e.checkpoint == f"model.ckpt-{e.step}"
    assert after[-1].step == last_step  # followed to the chief's final checkpoint
    # With the lease, a chosen checkpoint stays: none vanished under the restore. Only
    # one swept before the lease was written is passed over.
    assert raced  # the sweeps came while it evaluated, and the lease kept it listed
    vanished = named(events, "eval.vanished")
    assert all(v["reason"] == "swept before its lease was written" for v in vanished)
    saved = {os.path.basename(e["path"]) for e in named(events, "checkpoint.saved")}
    chosen = set(names) | {os.path.basename(v["path"]) for v in vanished}
    assert chosen <= saved  # only committed ones
    results = results_file(logdir)
    evaluated = {n: r["step"] for n, r in results.items() if not r["skipped"]}
    assert evaluated == {e.checkpoint: e.step for e in before + after}
    # Every commit since the first evaluator began: evaluated, or recorded as skipped.
    first_seen = min(r["seq"] for r in results.values())
    assert sorted(results) == sorted(committed_since(logdir, first_seen))
    steps = sorted(e.step for e in before + after)
    assert tensorboard_points(logdir, "eval/a") == [(s, float(s)) for s in steps]
    assert not (Path(logdir) / LEASE).exists()


@pytest.mark.asyncio
async def test_resumes_after_a_kill_between_its_events_and_its_results_skipping_none(
    logdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the events of one evaluation were written but before its result: the
    next run evaluates it again, and TensorBoard shows one point per step. An uncommitted
    checkpoint (complete files the state file does not name) is never evaluated."""
    await train(logdir, 8)  # checkpoints at 0, 2, 4, 6, 8, all kept
    write = _evaluator.write_evaluated
    calls = [0]

    def killed_on_the_third(logdir: str, results: dict[str, Any]) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError("killed")  # the events of step 4 are written already
        write(logdir, results)

    monkeypatch.setattr(_evaluator, "write_evaluated", killed_on_the_third)
    first, _ = evaluator(logdir)
    with pytest.raises(OSError, match="killed"):
        await first.run()
    assert sorted(results_file(logdir)) == ["model.ckpt-0", "model.ckpt-2"]
    assert not (Path(logdir) / LEASE).exists()  # let go on the way out

    for ext in ("index", "data-00000-of-00001"):  # complete, never committed
        shutil.copy(Path(logdir) / f"model.ckpt-8.{ext}", Path(logdir) / f"model.ckpt-100.{ext}")
    second, _ = evaluator(logdir)
    done = await second.run(until_step=8)
    assert [e.step for e in done] == [4, 6, 8]  # none of the first run's again
    assert sorted(results_file(logdir)) == [f"model.ckpt-{s}" for s in (0, 2, 4, 6, 8)]
    assert tensorboard_points(logdir, "eval/a") == [(s, float(s)) for s in (0, 2, 4, 6, 8)]
    assert asv.Evaluator  # the public name
    assert (await evaluator(logdir)[0].run(idle_secs=0.2)) == []  # nothing left


@pytest.mark.asyncio
async def test_nothing_is_evaluated_that_no_commit_names(logdir: str) -> None:
    await train(logdir, 2)
    os.remove(Path(logdir) / "checkpoint")  # the files are whole; nothing commits them
    for copy in Path(logdir).glob(".asupervisor.history*"):  # both copies
        copy.unlink()
    ev, _ = evaluator(logdir)
    assert await ev.run(idle_secs=0.2) == []
    assert ev.results() == {}


@pytest.mark.asyncio
async def test_a_lease_names_the_checkpoint_while_it_is_evaluated_renewed_and_let_go(
    logdir: str,
) -> None:
    await train(logdir, 1, max_to_keep=1)  # model.ckpt-1
    store, seen = Store(logdir), []

    def slow() -> dict[str, float]:
        for _ in range(2):
            seen.append((_leases.leased(store), json.loads(store.read(LEASE))))
            time.sleep(0.4)  # longer than the lease: renewed meanwhile
        return {"x": 1.0}

    ev, _ = evaluator(logdir, eval_fn=slow, lease_secs=0.3)
    assert [e.step for e in await ev.run(until_step=1)] == [1]
    (held, first), (still, second) = seen
    assert held == still == {"model.ckpt-1"}
    assert first["checkpoint"] == second["checkpoint"] == "model.ckpt-1"
    assert second["expires"] > first["expires"]  # renewed
    assert not store.exists(LEASE)  # let go after


@pytest.mark.asyncio
async def test_a_checkpoint_swept_before_its_lease_or_under_its_restore_is_passed_over(
    logdir: str, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the chief's side, a sweep can also come in the middle of the restore:
    logged, not an error, and the next one is evaluated."""
    await train(logdir, 4)  # 0, 2, 4
    store = Store(logdir)

    def sweep(name: str) -> None:
        for file in store.files_of(name):
            store.remove(file)

    hold = _evaluator.hold

    def swept_first(store: Store, reader: str, name: str, seconds: float) -> None:
        if name == "model.ckpt-0":  # the chief's sweep: the history first, then the files
            history = json.loads((Path(logdir) / ".asupervisor.history").read_text())
            for commit in history["commits"]:
                if commit["name"] == name:
                    commit["kept"] = "gone"
            (Path(logdir) / ".asupervisor.history").write_text(json.dumps(history))
            sweep(name)
        hold(store, reader, name, seconds)

    problem = _evaluator.checkpoint_problem

    def swept_while_read(store: Store, path: str) -> str | None:
        if path.endswith("model.ckpt-2"):
            sweep("model.ckpt-2")  # still named by the state file
        return problem(store, path)

    monkeypatch.setattr(_evaluator, "hold", swept_first)
    monkeypatch.setattr(_evaluator, "checkpoint_problem", swept_while_read)
    ev, _ = evaluator(logdir)
    assert [e.step for e in await ev.run(until_step=4)] == [4]
    vanished = {os.path.basename(e["path"]): e["reason"] for e in named(events, "eval.vanished")}
    assert vanished["model.ckpt-0"] == "swept before its lease was written"
    assert "NotFoundError" in vanished["model.ckpt-2"]
    results = ev.results()
    assert [n for n, r in results.items() if not r["skipped"]] == ["model.ckpt-4"]
    assert sorted(n for n, r in results.items() if r["skipped"]) == ["model.ckpt-0", "model.ckpt-2"]


@pytest.mark.asyncio
async def test_damaged_committed_checkpoints_are_passed_over_once(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """Each is logged once and never tried again (no loop over it), and the run goes on."""
    await train(logdir, 4)  # 0, 2, 4, all named by the state file
    data = Path(logdir) / "model.ckpt-0.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:10])  # a torn write
    os.remove(Path(logdir) / "model.ckpt-2.data-00000-of-00001")  # deleted by hand
    ev, _ = evaluator(logdir)
    with anyio.fail_after(120):
        assert [e.step for e in await ev.run(until_step=4)] == [4]
    damaged = [os.path.basename(e["path"]) for e in named(events, "eval.damaged")]
    assert damaged == ["model.ckpt-0", "model.ckpt-2"]


@pytest.mark.anyio  # and on trio
async def test_latest_only_takes_the_newest_and_says_what_it_skipped(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    await train(logdir, 6)  # 0, 2, 4, 6
    ev, _ = evaluator(logdir, latest_only=True)
    assert [e.step for e in await ev.run(until_step=6)] == [6]
    (skipped,) = named(events, "eval.skipped")
    assert [os.path.basename(p) for p in skipped["paths"]] == [
        "model.ckpt-0",
        "model.ckpt-2",
        "model.ckpt-4",
    ]


@pytest.mark.asyncio
async def test_a_keras_model_alone_is_restored_with_the_step_of_its_optimizer(
    logdir: str,
) -> None:
    """The trainer saves the model and its optimizer, with optimizer.iterations as the
    global step; the evaluator gives the model only. An unbuilt model, or one of another
    shape, is refused before anything is evaluated."""
    import keras

    def model(units: int = 1, built: bool = True) -> keras.Model:
        layers = [keras.Input((4,))] if built else []
        return keras.Sequential([*layers, keras.layers.Dense(units)])

    trained, opt = model(), keras.optimizers.SGD(0.1)
    x, y = tf.ones((8, 4)), tf.zeros((8, 1))

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((trained(x) - y) ** 2)
        grads = tape.gradient(loss, trained.trainable_weights)
        opt.apply_gradients(zip(grads, trained.trainable_weights, strict=True))
        return loss

    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": trained, "opt": opt},
        global_step=opt.iterations,  # the default save_model_secs: a save at 0, the final at 3
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(step)
    evaluated = model()
    ev = asv.Evaluator(
        logdir,
        checkpoint={"model": evaluated},
        eval_fn=lambda: {"loss": tf.reduce_mean((evaluated(x) - y) ** 2)},
        poll_secs=0.02,
    )
    at_start, done = await ev.run(until_step=3)
    assert (at_start.step, done.step) == (0, 3)
    assert done.metrics["loss"] == pytest.approx(float(tf.reduce_mean((trained(x) - y) ** 2)))
    for wrong, match in (
        (model(built=False), "build the model"),
        (model(2), r"checkpoint \(4, 1\), model \(4, 2\)"),
    ):
        shutil.rmtree(Path(logdir) / "eval")
        bad = asv.Evaluator(logdir, checkpoint={"model": wrong}, eval_fn=dict, poll_secs=0.02)
        with pytest.raises(asv.CheckpointMismatchError, match=match):
            await bad.run(until_step=3)


@pytest.mark.asyncio
async def test_bad_arguments_and_a_second_evaluator_are_refused(logdir: str) -> None:
    pair = Pair()
    good: dict[str, Any] = {"checkpoint": {"pair": pair}, "eval_fn": dict}
    for name, value in [
        ("checkpoint", None),
        ("eval_fn", 3),
        ("poll_secs", 0),
        ("latest_only", "yes"),
        ("lease_secs", -1),
        ("name", ""),
    ]:
        with pytest.raises(ValueError, match=name):
            asv.Evaluator(logdir, **{**good, name: value})
    with pytest.raises(ValueError, match="logdir"):
        asv.Evaluator(3, **good)  # type: ignore[arg-type]
    ev = asv.Evaluator(logdir, **good)
    with pytest.raises(ValueError, match="until_step"):
        await ev.run(until_step=-1)
    with pytest.raises(ValueError, match="idle_secs"):
        await ev.run(idle_secs=0)

    await train(logdir, 1)
    ev = asv.Evaluator(logdir, checkpoint={"pair": pair}, eval_fn=lambda: {"x": "high"})
    with pytest.raises(ValueError, match="eval_fn returned 'high'"):
        await ev.run()
    running = asv.Evaluator(logdir, **good)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(running.run)
        await anyio.sleep(0.3)
        with pytest.raises(asv.LogdirLockedError, match="another evaluator"):
            await asv.Evaluator(logdir, **good).run()
        running.stop()


SCRIPT = """
import threading
import time
from pathlib import Path
import tensorflow as tf

def make_evaluator():
    a = tf.Variable(0.0)
    b = tf.Variable(0.0)
    pair = tf.Module()
    pair.a, pair.b = a, b

    def eval_fn():
        Path(__file__).with_name("evaluating").write_text(str(float(a.numpy())))
        time.sleep(0.5)
        return {"a": a}

    return {"pair": pair}, eval_fn
"""


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_command_stops_after_the_evaluation_in_flight_on_sigterm_and_resumes(
    logdir: str, tmp_path: Path
) -> None:
    await train(logdir, 6)  # 0, 2, 4, 6
    script = tmp_path / "evaluate_pair.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, "-m", "asupervisor", "evaluate", logdir, "--script", str(script)]
    proc = forked.Popen(
        [*command, "--poll-secs", "0.1"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "evaluating").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            await anyio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # in the middle of the first evaluation
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 42, stderr  # stopped by a signal: run it again to go on
    assert "eval.evaluated" in stderr and "signal.received" in stderr
    assert sorted(results_file(logdir)) == ["model.ckpt-0"]  # the one in flight, recorded
    assert not (Path(logdir) / LEASE).exists()

    ev, _ = evaluator(logdir)
    assert [e.step for e in await ev.run(until_step=6)] == [2, 4, 6]
    assert [s for s, _ in tensorboard_points(logdir, "eval/a")] == [0, 2, 4, 6]


def test_the_command_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["evaluate", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "def make_evaluator():" in out and 'return {"model": model}, eval_fn' in out
    assert "asupervisor evaluate runs/digits --script evaluate_digits.py" in out
    with pytest.raises(SystemExit) as exit:
        main(["evaluate", "runs/x"])  # neither --script nor --module
    assert exit.value.code == 2


def test_a_factory_that_fails_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "broken.py"
    script.write_text("def make_evaluator():\n    return 'not a pair'\n")
    assert main(["evaluate", str(tmp_path / "run"), "--script", str(script)]) == 78
    assert "(checkpoint, eval_fn)" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "run"), "--module", "json:nothing"]) == 78


@pytest.mark.asyncio
async def test_the_digits_example_evaluates_a_digits_run(logdir: str) -> None:
    """``examples/evaluate_digits.py`` fits what ``examples/digits.py`` saves."""
    import keras

    from asupervisor._cli.evaluate import load_factory

    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": model, "optimizer": keras.optimizers.Adam()},
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session():
        pass  # the checkpoint at step 0, and the final one
    example = Path(__file__).parents[1] / "examples" / "evaluate_digits.py"
    checkpoint, eval_fn = load_factory(str(example), None)()
    ev = asv.Evaluator(logdir, checkpoint=checkpoint, eval_fn=eval_fn, poll_secs=0.02)
    (done,) = await ev.run(until_step=0)
    assert set(done.metrics) == {"accuracy", "loss"} and 0 <= done.metrics["accuracy"] <= 1


@pytest.mark.asyncio
async def test_an_object_store_logdir(tmp_path: Path) -> None:
    """TF's in-memory ram:// stands in for gs://: leases, the lock of eval/ (a lease
    there), results and events all go through the store."""
    logdir = f"ram://{tmp_path.name}/run"
    await train(logdir, 2)  # 0, 2
    ev, _ = evaluator(logdir)
    assert [e.step for e in await ev.run(until_step=2)] == [0, 2]
    assert sorted(read_results(logdir)) == ["model.ckpt-0", "model.ckpt-2"]
    assert any(n.startswith("events.out") for n in tf.io.gfile.listdir(f"{logdir}/eval"))
    assert not tf.io.gfile.exists(f"{logdir}/{LEASE}")
    assert await evaluator(logdir)[0].run(until_step=2) == []  # the lock was let go


# -- every committed checkpoint once, or recorded skipped: the evaluator's backlog ------


def committed_since(logdir: str, since: int) -> list[str]:
    return [c.name for c in read_history(Store(logdir)).commits if c.seq >= since]


@pytest.mark.asyncio
async def test_with_max_to_keep_1_and_slow_evaluations_every_commit_is_evaluated_once(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """The chief keeps one checkpoint and commits at every step; the evaluator takes
    longer than a step, and is stopped and started again in the middle while the chief
    commits on. Retention keeps what it has not evaluated (within its backlog)."""
    last_step = 16
    count, first_done, gap_done = [0], anyio.Event(), anyio.Event()
    pair = Pair()

    def first_fn() -> dict[str, Any]:
        count[0] += 1
        time.sleep(0.1)
        if count[0] == 2:
            first.stop()
        return {"a": pair.a, "b": pair.b.numpy()}

    first = asv.Evaluator(
        logdir, checkpoint={"pair": pair}, eval_fn=first_fn, poll_secs=0.02, backlog=32
    )

    async def chief() -> None:
        trained = Pair()
        sv = pair_supervisor(logdir, trained, max_to_keep=1, save_model_steps=1)
        async with sv.session() as sess:
            for _ in range(last_step):
                await sess.run(trained.step)
                if sess.global_step == 6:
                    await first_done.wait()  # the commits from here come while none runs
        gap_done.set()

    evaluations: list[asv.Evaluation] = []

    async def evaluators() -> None:
        evaluations.extend(await first.run())
        first_done.set()
        await gap_done.wait()
        second, _ = evaluator(logdir, backlog=32)
        evaluations.extend(await second.run(until_step=last_step))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(chief)
            tasks.start_soon(evaluators)

    names = [e.checkpoint for e in evaluations]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(committed_since(logdir, 1))  # every commit, once
    assert not named(events, "eval.skipped") and not named(events, "eval.vanished")
    for e in evaluations:
        assert e.metrics == {"a": float(e.step), "b": float(e.step)}


@pytest.mark.asyncio
async def test_past_its_backlog_the_commits_it_missed_are_recorded_as_skipped(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """The first evaluation holds while the chief commits ten more with one kept and a
    backlog of one: the ones swept meanwhile are in the results as skipped, and logged."""
    pair, started, release = Pair(), threading.Event(), threading.Event()

    def held() -> dict[str, Any]:
        started.set()
        release.wait(60)
        return {"a": pair.a, "b": pair.b.numpy()}

    ev = asv.Evaluator(logdir, checkpoint={"pair": pair}, eval_fn=held, poll_secs=0.02, backlog=1)

    async def chief() -> None:
        trained = Pair()
        sv = pair_supervisor(logdir, trained, max_to_keep=1, save_model_steps=1)
        async with sv.session() as sess:
            await anyio.to_thread.run_sync(started.wait, 60)
            for _ in range(10):
                await sess.run(trained.step)
        release.set()

    done: list[asv.Evaluation] = []

    async def evaluate() -> None:
        done.extend(await ev.run(until_step=10))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(evaluate)
            tasks.start_soon(chief)

    results = results_file(logdir)
    everything = committed_since(logdir, 1)
    assert sorted(results) == sorted(everything)  # each one: evaluated or skipped
    skipped = sorted(n for n, r in results.items() if r.get("skipped"))
    evaluated = sorted(e.checkpoint for e in done)
    assert skipped and not set(skipped) & set(evaluated)
    assert sorted(skipped + evaluated) == sorted(everything)
    logged = [os.path.basename(p) for e in named(events, "eval.skipped") for p in e["paths"]]
    assert sorted(logged) == skipped
    assert "model.ckpt-10" in evaluated  # the newest is never the one skipped
