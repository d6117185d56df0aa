"""`sess.fit` is one `model.fit` call: Keras' callbacks, stops and History work as in fit."""

from __future__ import annotations

import glob
import os
import time
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv

pytestmark = pytest.mark.asyncio

BATCHES = 8  # per epoch


def arrays(n: int = BATCHES * 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


def dataset(seed: int = 0) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(arrays(seed=seed)).batch(8)  # 8 batches


def seen_model(seen: list[float]) -> keras.Model:
    """A model that records the first feature of each batch it trains on (which batch)."""

    def record(v: tf.Tensor) -> float:
        seen.append(float(v[0, 0]))
        return 0.0

    class Seen(keras.Sequential):
        def train_step(self, data: Any) -> Any:
            x, _ = data
            with tf.control_dependencies([tf.py_function(record, [x], tf.float32)]):
                return super().train_step(data)

    return Seen([keras.Input((4,)), keras.layers.Dense(1)])


def compiled(
    seen: list[float] | None = None, lr: float = 0.01, metrics: tuple[str, ...] = ()
) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = (
        seen_model(seen)
        if seen is not None
        else keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    )
    # Not XLA: py_function (the record above) and summaries run only outside it.
    model.compile(
        optimizer=keras.optimizers.SGD(lr), loss="mse", metrics=list(metrics), jit_compile=False
    )
    return model


def supervisor(logdir: str, model: keras.Model, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_model_steps", 1000)
    kwargs.setdefault("save_summaries_secs", 0)
    return asv.Supervisor(
        logdir,
        checkpoint={"model": model, "opt": model.optimizer},
        handle_signals=False,
        **kwargs,
    )


class Record(keras.callbacks.Callback):
    """What Keras told the callbacks, in order."""

    def __init__(self, stop_at: tuple[str, int, int] | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, int | None]] = []
        self.stop_at = stop_at  # (hook, epoch, batch): ask the session to stop there
        self.sess: asv.ManagedSession | None = None
        self.epoch = -1

    def _maybe_stop(self, where: str, batch: int) -> None:
        if self.stop_at == (where, self.epoch, batch) and self.sess is not None:
            self.sess.request_stop(reason=asv.StopReason.SIGNAL)

    def on_train_begin(self, logs: Any = None) -> None:
        self.calls.append(("train_begin", None))

    def on_train_end(self, logs: Any = None) -> None:
        self.calls.append(("train_end", None))

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch
        self.calls.append(("epoch_begin", epoch))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.calls.append(("epoch_end", epoch))

    def on_test_begin(self, logs: Any = None) -> None:
        self.calls.append(("test_begin", self.epoch))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._maybe_stop("train", batch)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self._maybe_stop("test", batch)

    def of(self, kind: str) -> list[int | None]:
        return [epoch for name, epoch in self.calls if name == kind]


async def test_a_function_of_the_epoch_is_one_fit_call_for_all_epochs(logdir: str) -> None:
    model, record = compiled(), Record()
    called: list[int] = []

    def data(epoch: int) -> tf.data.Dataset:
        called.append(epoch)
        return dataset().shuffle(64, seed=epoch)

    async with supervisor(logdir, model).session() as sess:
        history = await sess.fit(model, data, epochs=8, callbacks=[record], verbose=0)
    assert record.of("train_begin") == [None]  # Keras resets its callbacks here: once
    assert record.of("epoch_begin") == list(range(8))
    assert history.epoch == list(range(8)) and len(history.history["loss"]) == 8
    assert sorted(set(called)) == list(range(8))
    assert sess.global_step == 8 * BATCHES and sess.data_position == (8, 0)


async def test_early_stopping_and_reduce_lr_on_plateau_act_as_in_plain_fit(logdir: str) -> None:
    def callbacks() -> list[keras.callbacks.Callback]:
        # An improvement must beat 1e9: none does, so the schedule is known in advance.
        return [
            keras.callbacks.EarlyStopping("val_loss", min_delta=1e9, patience=3),
            keras.callbacks.ReduceLROnPlateau("val_loss", factor=0.5, patience=1, min_delta=1e9),
        ]

    val = dataset(seed=1)
    plain = compiled()
    expected = plain.fit(
        dataset(), epochs=10, validation_data=val, callbacks=callbacks(), verbose=0
    )
    assert len(expected.epoch) < 10  # EarlyStopping ended it

    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        history = await sess.fit(
            model, dataset(), epochs=10, validation_data=val, callbacks=callbacks(), verbose=0
        )
    assert history.epoch == expected.epoch  # stopped after the same epoch
    assert history.history["learning_rate"] == expected.history["learning_rate"]
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], 1e-5)
    assert sess.global_step == len(expected.epoch) * BATCHES


async def test_a_callbacks_stop_stays_when_the_run_is_started_again(logdir: str) -> None:
    stop = keras.callbacks.EarlyStopping("loss", min_delta=1e9, patience=1)
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        history = await sess.fit(model, dataset(), epochs=10, callbacks=[stop], verbose=0)
    assert history.epoch == [0, 1]
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        again = await sess.fit(model, dataset(), epochs=10, verbose=0)
    assert isinstance(again, keras.callbacks.History) and again.epoch == []
    assert sess.global_step == 2 * BATCHES  # nothing trained: the callback's stop stands


async def test_a_resumed_fit_with_nothing_left_gives_the_callbacks_their_state(
    logdir: str,
) -> None:
    """Found by the search of tests/test_resume_equivalence.py: a run killed after its final
    save, started again, had nothing left to train, and its callbacks stayed as made."""

    def callbacks() -> list[keras.callbacks.Callback]:
        return [
            keras.callbacks.EarlyStopping("val_loss", patience=5),
            keras.callbacks.ReduceLROnPlateau("val_loss", patience=1, min_delta=1e9),
        ]

    ended = callbacks()
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, dataset(), epochs=3, validation_data=dataset(1), callbacks=ended,
                       verbose=0)  # fmt: skip
    made = callbacks()
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, dataset(), epochs=3, validation_data=dataset(1), callbacks=made,
                       verbose=0)  # fmt: skip
    fields = ("wait", "best", "best_epoch", "stopped_epoch", "cooldown_counter")
    for old, new in zip(ended, made, strict=True):
        for field in fields:
            if hasattr(old, field):
                assert getattr(new, field) == getattr(old, field), (type(old).__name__, field)
    assert made[0].best is not None and made[1].best is not None  # a state given back


async def test_a_resumed_fit_with_nothing_left_returns_an_empty_history(logdir: str) -> None:
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, dataset(), epochs=2, verbose=0)
    trained = [v.numpy() for v in model.optimizer.variables]
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        history = await sess.fit(model, dataset(), epochs=2, verbose=0)
    assert isinstance(history, keras.callbacks.History)
    assert history.epoch == [] and history.history == {}
    # The optimizer took its saved state (TF warned of values left in the checkpoint).
    assert model.optimizer.built
    resumed = [v.numpy() for v in model.optimizer.variables]
    assert len(resumed) == len(trained) > 1
    assert all(np.array_equal(a, b) for a, b in zip(resumed, trained, strict=True))


def runs(logdir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Each run's scalar points by tag, as TensorBoard's own loader reads them."""
    from tensorboard.backend.event_processing import plugin_event_accumulator

    found = {}
    for run in ("train", "validation"):
        acc = plugin_event_accumulator.EventAccumulator(
            os.path.join(logdir, run), size_guidance={"tensors": 0}
        )
        acc.Reload()
        found[run] = {
            tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
        }
    return found


async def test_epoch_logs_are_keras_runs_that_overlay_a_plain_keras_run(
    logdir: str, tmp_path: Any
) -> None:
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, dataset(), epochs=3, validation_data=dataset(seed=1), verbose=0)
    ours = runs(logdir)

    keras_dir = str(tmp_path / "keras")  # the same training under Keras' own callback
    plain = compiled()
    plain.fit(
        dataset(), epochs=3, validation_data=dataset(seed=1), verbose=0, shuffle=False,
        callbacks=[keras.callbacks.TensorBoard(keras_dir)],
    )  # fmt: skip
    theirs = runs(keras_dir)
    # Keras' validation metrics at the global step are left out (see docs/tensorboard.md).
    theirs["validation"] = {
        t: p for t, p in theirs["validation"].items() if not t.startswith("evaluation_")
    }
    assert sorted(ours["train"]) == ["epoch_learning_rate", "epoch_loss"]
    assert sorted(ours["validation"]) == ["epoch_loss"]
    for run in ("train", "validation"):
        assert sorted(ours[run]) == sorted(theirs[run])
        for tag, points in theirs[run].items():
            assert [s for s, _ in ours[run][tag]] == [s for s, _ in points] == [0, 1, 2]
            assert [v for _, v in ours[run][tag]] == pytest.approx([v for _, v in points])


async def test_a_resumed_fit_draws_each_epoch_once(logdir: str) -> None:
    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.model.optimizer.iterations.numpy() == BATCHES + 3:
                raise RuntimeError("crash")  # epoch 0's end written; no checkpoint after 0

    model = compiled()
    with pytest.raises(RuntimeError, match="crash"):
        async with supervisor(logdir, model).session() as sess:
            await sess.fit(
                model, dataset(), epochs=3, validation_data=dataset(seed=1),
                callbacks=[Crash()], verbose=0,
            )  # fmt: skip
    model = compiled(lr=0.02)  # other values: the crashed session's points must not show
    async with supervisor(logdir, model).session() as sess:
        assert sess.data_position == (0, 0)
        history = await sess.fit(
            model, dataset(), epochs=3, validation_data=dataset(seed=1), verbose=0
        )
    drawn = runs(logdir)
    for run, name in (("train", "loss"), ("validation", "val_loss")):
        points = drawn[run]["epoch_loss"]
        assert [s for s, _ in points] == [0, 1, 2]
        assert [v for _, v in points] == pytest.approx(history.history[name])
    # The crashed session's own files lost the epochs done again (TensorBoard's default
    # loader ignores the SessionLog.START that drops them for the one read above).
    for run in ("train", "validation"):
        crashed = sorted(glob.glob(os.path.join(logdir, run, "events.out.tfevents.*")))[0]
        steps = [e.step for e in tf.compat.v1.train.summary_iterator(crashed) if e.summary.value]
        assert steps == [], (run, steps)


async def test_a_stop_mid_epoch_runs_the_cut_epochs_end_once_in_the_resumed_run(
    logdir: str,
) -> None:
    seen: list[float] = []
    model, record = compiled(seen), Record(stop_at=("train", 1, 2))
    async with supervisor(logdir, model).session() as sess:
        record.sess = sess
        await sess.fit(
            model, dataset(), epochs=3, validation_data=dataset(seed=1), callbacks=[record],
            verbose=0,
        )  # fmt: skip
    assert sess.data_position == (1, 3) and sess.global_step == BATCHES + 3
    assert record.of("epoch_end") == [0]  # not the cut epoch 1
    assert record.of("test_begin") == [0]  # no validation of it either
    assert record.of("train_end") == [None]
    first_run = list(seen)

    seen.clear()
    model, again = compiled(seen), Record()
    async with supervisor(logdir, model).session() as sess:
        assert sess.data_position == (1, 3)
        await sess.fit(
            model, dataset(), epochs=3, validation_data=dataset(seed=1), callbacks=[again],
            verbose=0,
        )  # fmt: skip
    assert again.of("epoch_begin") == [1, 2] and again.of("epoch_end") == [1, 2]
    assert again.of("test_begin") == [1, 2]
    assert sess.global_step == 3 * BATCHES and sess.data_position == (3, 0)
    firsts = [float(x[0, 0]) for x, _ in dataset()]  # each batch's first value
    assert first_run + seen == firsts + firsts + firsts  # nothing twice, nothing skipped


class EpochLogs(keras.callbacks.Callback):
    """The logs of each epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[int, dict[str, float]] = {}

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.logs[epoch] = {k: float(v) for k, v in (logs or {}).items()}


async def fit_with_a_stop(
    logdir: str, stop_at: tuple[str, int, int] | None
) -> tuple[list[float], dict[int, dict[str, float]], list[np.ndarray]]:
    """Batches trained (their first value, in order), epoch logs and weights of a run of
    3 epochs over a reshuffling function of the epoch, stopped at ``stop_at`` (as a
    SIGTERM would) and resumed."""
    seen: list[float] = []
    logs = EpochLogs()

    def data(epoch: int) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices(arrays()).shuffle(64, seed=epoch).batch(8)

    for record in [Record(stop_at=stop_at), Record()] if stop_at else [Record()]:
        model = compiled(seen, metrics=("mae",))  # a compiled metric, built at the first batch
        async with supervisor(logdir, model).session() as sess:
            record.sess = sess
            await sess.fit(
                model, data, epochs=3, validation_data=dataset(seed=1),
                callbacks=[record, logs], verbose=0,
            )  # fmt: skip
    assert sess.data_position == (3, 0)
    return seen, logs.logs, [w.numpy() for w in model.weights]


async def test_a_resumed_fit_reads_each_epoch_as_the_run_left_alone_does(tmp_path: Any) -> None:
    """Keras opens an epoch's data at the end of the epoch before and again at its start:
    read twice, a reshuffling dataset would give the resumed epoch another order."""
    alone = await fit_with_a_stop(str(tmp_path / "alone"), None)
    for where in [("train", 1, 2), ("train", 0, BATCHES - 1), ("test", 1, 0)]:
        resumed = await fit_with_a_stop(str(tmp_path / "-".join(map(str, where))), where)
        assert resumed[0] == alone[0], where  # the same batches, in the same order
        assert all(np.array_equal(a, b) for a, b in zip(resumed[2], alone[2], strict=True))


async def test_a_resumed_epoch_reports_the_means_of_all_its_batches(logdir: str) -> None:
    """Keras' logs are running means over the epoch: the resumed epoch's include the
    batches trained before the stop, so callbacks watching them act as in a run left alone."""
    _, alone, _ = await fit_with_a_stop(logdir + "-alone", None)
    _, resumed, _ = await fit_with_a_stop(logdir, ("train", 1, 2))
    assert resumed[1] == alone[1] and resumed[2] == alone[2]
    assert "mae" in resumed[1] and "val_mae" in resumed[1]


async def test_a_stop_during_validation_trains_nothing_more_and_the_resumed_run_ends_it(
    logdir: str,
) -> None:
    model, record = compiled(), Record(stop_at=("test", 1, 1))
    async with supervisor(logdir, model).session() as sess:
        record.sess = sess
        await sess.fit(
            model, dataset(), epochs=3, validation_data=dataset(seed=1), callbacks=[record],
            verbose=0,
        )  # fmt: skip
    assert sess.global_step == 2 * BATCHES  # not one batch of epoch 2
    assert sess.data_position == (1, BATCHES)  # epoch 1 trained; its end still due
    assert record.of("epoch_end") == [0]

    model, again = compiled(), Record()
    async with supervisor(logdir, model).session() as sess:
        history = await sess.fit(
            model, dataset(), epochs=3, validation_data=dataset(seed=1), callbacks=[again],
            verbose=0,
        )  # fmt: skip
    assert again.of("epoch_begin") == [2]  # epoch 1 is not trained again...
    assert again.of("epoch_end") == [1, 2]  # ...but its end, interrupted, runs first
    assert len(again.of("test_begin")) == 2  # with its validation, whole this time
    assert history.epoch == [1, 2] and "loss" in history.history
    assert sess.global_step == 3 * BATCHES and sess.data_position == (3, 0)


async def test_steps_per_epoch_resumes_in_the_stream_where_it_stopped(logdir: str) -> None:
    seen: list[float] = []
    stream = dataset().repeat()

    class StopAt6(asv.Hook):
        def after_run(self, ctx: asv.RunContext, result: Any) -> None:
            if ctx.session.global_step == 6:
                ctx.session.request_stop()

    model = compiled(seen)
    sv = supervisor(logdir, model, hooks=[StopAt6()])
    async with sv.session() as sess:
        await sess.fit(model, stream, epochs=3, steps_per_epoch=4, verbose=0)
    assert sess.global_step == 6 and sess.data_position == (1, 2)
    model = compiled(seen)
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, stream, epochs=3, steps_per_epoch=4, verbose=0)
    assert sess.global_step == 12 and sess.data_position == (3, 0)
    firsts = [float(x[0, 0]) for x, _ in dataset()]
    assert seen == firsts + firsts[:4]  # one stream: batches 0..11, none twice


async def test_steps_per_epoch_that_a_finite_stream_cannot_repeat_is_refused(logdir: str) -> None:
    model = compiled()
    async with supervisor(logdir, model).session() as sess:
        with pytest.raises(ValueError, match="steps_per_epoch=3"):
            await sess.fit(model, dataset(), epochs=2, steps_per_epoch=3)


async def test_in_step_summaries_under_fit_are_labelled_with_the_step_they_lead_to(
    logdir: str,
) -> None:
    class Logged(keras.Sequential):
        def call(self, x: Any, training: bool = False) -> Any:
            tf.summary.scalar("in_step", tf.reduce_mean(x))
            return super().call(x, training=training)

    keras.utils.set_random_seed(0)
    model = Logged([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)  # XLA drops summaries
    x, y = arrays(48)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 6 batches
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, data, epochs=1, verbose=0)
    (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    acc = EventAccumulator(path, size_guidance={"tensors": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.endswith("in_step")]  # the model's scope
    assert [e.step for e in acc.Tensors(tag)] == [1, 2, 3, 4, 5, 6]


async def test_steps_per_execution_counts_every_batch(logdir: str) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, dataset(), epochs=2, verbose=0)
    assert sess.global_step == 2 * BATCHES and sess.data_position == (2, 0)
    assert int(model.optimizer.iterations.numpy()) == 2 * BATCHES


async def test_validation_and_epoch_ends_are_no_stalled_step(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    class Slow(keras.callbacks.Callback):  # each longer than the summary interval
        def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
            time.sleep(0.1)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            time.sleep(1.0)

    model = compiled()
    sv = supervisor(logdir, model, save_summaries_secs=0.5)
    async with sv.session() as sess:
        await sess.fit(
            model, dataset(), epochs=2, validation_data=dataset(seed=1), callbacks=[Slow()],
            verbose=0,
        )  # fmt: skip
    assert [e for e in events if e["event"] == "step.stalled"] == []


async def test_epoch_logs_into_a_writer_of_yours_keep_the_split_in_their_names(
    tmp_path: Any,
) -> None:
    mine = str(tmp_path / "mine")
    writer = tf.summary.create_file_writer(mine)
    model = compiled()
    sv = asv.Supervisor(
        None, checkpoint={"model": model}, summary_writer=writer, save_summaries_secs=0,
        handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.fit(model, dataset(), epochs=2, validation_data=dataset(seed=1), verbose=0)
    writer.close()
    acc = EventAccumulator(mine, size_guidance={"tensors": 0})
    acc.Reload()
    for tag in ("epoch_loss", "epoch_val_loss", "epoch_learning_rate"):
        assert [e.step for e in acc.Tensors(tag)] == [0, 1], sorted(acc.Tags()["tensors"])
    assert all(n.startswith("events.out.tfevents.") for n in os.listdir(mine))  # no runs


async def test_keras_tensorboard_callback_in_fit_is_said_once_with_what_to_do(
    logdir: str, tmp_path: Any, events: list[dict[str, Any]]
) -> None:
    # sess.fit writes Keras' epoch runs itself; Keras' callback would add batch_<metric>
    # points at a counter that starts again in each session (docs/fit.md).
    model = compiled()
    callback = keras.callbacks.TensorBoard(str(tmp_path / "keras"))
    async with supervisor(logdir, model).session() as sess:
        await sess.fit(model, dataset(), epochs=2, verbose=0, callbacks=[callback])
    (said,) = [e for e in events if e["event"] == "fit.tensorboard_callback"]
    assert said["log_level"] == "warning" and "leave the callback out" in said["hint"]
    async with supervisor(str(tmp_path / "other"), model).session() as sess:
        await sess.fit(model, dataset(), epochs=1, verbose=0)  # without it: nothing said
    assert len([e for e in events if e["event"] == "fit.tensorboard_callback"]) == 1
