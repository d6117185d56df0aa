"""Each checkpoint holds the state of the tf.data iterator read at its step boundary: a
resumed run restores it and reads on, computing no batch before the one it resumes at;
where no state can be (or the checkpoint has none) it goes there by Dataset.skip, and says
what that costs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.anyio

ELEMENTS = 400  # an epoch: 40 batches of 10
# What the data is, not how the loop runs: one backend is enough.
ONE_LOOP = pytest.mark.parametrize("anyio_backend", ["asyncio"])


class Counted:
    """A pipeline that counts the elements it computes (its map's own variable, which
    the iterator's state leaves out: ``ExternalStatePolicy.IGNORE``)."""

    def __init__(self) -> None:
        self.computed = tf.Variable(0, dtype=tf.int64)

    def data(self, epoch: int) -> tf.data.Dataset:
        computed = self.computed

        def count(i: tf.Tensor) -> tf.Tensor:
            computed.assign_add(1)
            return i + 1000 * epoch

        options = tf.data.Options()
        options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        return tf.data.Dataset.range(ELEMENTS).map(count).batch(10).with_options(options)


class Learner(tf.Module):
    """Records the first element of each batch it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.v = tf.Variable(0.0)
        self.seen: list[int] = []

    def step(self, batch: tf.Tensor) -> dict[str, tf.Tensor]:
        self.seen.append(int(batch[0]))
        self.v.assign_add(1.0)
        return {"loss": tf.constant(1.0)}


def supervisor(logdir: str, learner: Learner, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_steps", 10)
    return asv.Supervisor(
        logdir,
        checkpoint={"learner": learner},
        save_model_secs=0,
        save_summaries_secs=0,
        handle_signals=False,
        **kwargs,
    )


async def train(logdir: str, data: Any, steps: int, **kwargs: Any) -> Learner:
    learner = Learner()
    async with supervisor(logdir, learner, **kwargs).session() as sess:
        await sess.train(learner.step, data, epochs=2, max_steps=steps)
    return learner


async def test_a_resume_inside_an_epoch_computes_no_batch_before_it(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    pipeline = Counted()
    first = await train(logdir, pipeline.data, 30)  # saved at batch 30 of epoch 0
    assert first.seen[-1] == 290
    pipeline.computed.assign(0)
    again = await train(logdir, pipeline.data, 1)
    assert again.seen == [300]  # the batch after the checkpoint...
    assert int(pipeline.computed.numpy()) < 50  # ...and its elements, not the 300 before
    (resumed,) = named(events, "data.resumed")
    assert resumed["key"] == 0 and resumed["batch"] == 30
    assert not named(events, "data.resume_by_skip")


async def test_an_older_checkpoint_without_the_iterator_resumes_by_skip(
    tmp_path: Path, events: list[dict[str, Any]]
) -> None:
    """A checkpoint of the position alone (as written before the iterator was saved)."""
    logdir = str(tmp_path / "run")
    learner = Learner()
    learner.v.assign(30.0)
    position = tf.Module()
    position.epoch = tf.Variable(0, dtype=tf.int64)
    position.batch = tf.Variable(30, dtype=tf.int64)
    older = tf.train.Checkpoint(
        root=tf.train.Checkpoint(learner=learner),
        global_step=tf.Variable(30, dtype=tf.int64),
        data_position=position,
    )
    _ = older.save_counter  # as every checkpoint the supervisor writes has
    prefix = older.write(f"{logdir}/model.ckpt-30")
    tf.compat.v1.train.update_checkpoint_state(logdir, prefix)

    pipeline = Counted()
    again = await train(logdir, pipeline.data, 1)
    assert again.seen == [300] and float(again.v.numpy()) == 31.0
    assert int(pipeline.computed.numpy()) >= 310  # the 30 batches before it, again
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["batches"] == 30 and "no state" in skip["reason"]


async def test_a_pipeline_tf_cannot_save_resumes_by_skip_and_says_so_at_start(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    def data(epoch: int) -> tf.data.Dataset:
        ids = tf.data.Dataset.range(ELEMENTS)
        return ids.map(lambda i: tf.py_function(lambda x: x, [i], tf.int64)).batch(10)

    await train(logdir, data, 30)
    (first,) = named(events, "data.not_saveable")
    assert "stateful" in first["reason"]  # TF's own words: a py_function has state
    events.clear()
    again = await train(logdir, data, 2)
    assert again.seen == [300, 310]  # by skip: slower, as exact
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["batches"] == 30 and "stateful" in skip["reason"]
    assert "computed again" in skip["cost"]


async def test_a_pipeline_changed_since_the_save_falls_back_to_skip(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    await train(logdir, Counted().data, 30)

    def changed(epoch: int) -> tf.data.Dataset:  # a filter more: another pipeline
        numbers = tf.data.Dataset.range(ELEMENTS).filter(lambda i: i >= 0)
        return numbers.map(lambda i: i * 2).batch(10)

    again = await train(logdir, changed, 1)
    assert again.seen == [600]  # batch 30 of the pipeline given now
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["reason"] == "the pipeline changed"


async def test_an_async_save_holds_the_iterator_of_its_own_step_boundary(logdir: str) -> None:
    pipeline = Counted()
    with pytest.raises(RuntimeError, match="crash"):
        learner = Learner()
        sv = supervisor(logdir, learner, async_checkpoint=True, save_model_steps=7)
        async with sv.session() as sess:
            await sess.train(learner.step, pipeline.data, epochs=2, max_steps=23)
            raise RuntimeError("crash: no final save")  # as a kill: the last save was at 21
    pipeline.computed.assign(0)
    again = await train(logdir, pipeline.data, 1)
    assert again.seen == [210] and float(again.v.numpy()) == 22.0
    assert int(pipeline.computed.numpy()) < 50


async def test_a_reshuffling_dataset_given_once_resumes_each_later_epoch_in_its_order(
    tmp_path: Path,
) -> None:
    """The same dataset every epoch, reshuffled at each iteration: its next order comes
    from its seed generator, which the iterator's state restores."""

    def data() -> tf.data.Dataset:  # made anew by each run, as each process would
        return tf.data.Dataset.range(ELEMENTS).shuffle(ELEMENTS, seed=3).batch(10)

    alone = await train(str(tmp_path / "alone"), data(), 80)
    assert alone.seen[:40] != alone.seen[40:]  # the second epoch in another order
    for cut in (17, 40):  # inside the first epoch; at the second's first batch
        logdir = str(tmp_path / f"cut{cut}")
        first = await train(logdir, data(), cut)
        rest = await train(logdir, data(), 80 - cut)
        assert first.seen + rest.seen == alone.seen, cut


async def test_a_reshuffling_dataset_whose_saved_state_read_past_its_shuffle_resumes_in_order(
    tmp_path: Path,
) -> None:
    """A state taken once the pipeline has read its shuffle to the end (a prefetch that ran
    ahead of training does it at TF's own pace) holds no count of the shuffle's seed
    generator: restoring it must not leave the next epoch's order one draw on."""

    def read_ahead() -> tf.data.Dataset:  # the whole shuffled epoch read at its first batch
        once = tf.data.Dataset.range(ELEMENTS).shuffle(ELEMENTS, seed=3).batch(ELEMENTS + 1)
        return once.unbatch().batch(10)

    def unknown_length() -> tf.data.Dataset:  # its epoch's end is found by reading
        numbers = tf.data.Dataset.range(ELEMENTS).filter(lambda i: i >= 0)
        return numbers.shuffle(ELEMENTS, seed=3).batch(10)

    # Inside the first epoch; at its last batch, whose end TF cannot tell before reading.
    for data, cut in ((read_ahead, 17), (unknown_length, 40)):
        alone = await train(str(tmp_path / f"alone{cut}"), data(), 80)
        assert alone.seen[:40] != alone.seen[40:]  # the second epoch in another order
        logdir = str(tmp_path / f"cut{cut}")
        first = await train(logdir, data(), cut)
        rest = await train(logdir, data(), 80 - cut)
        assert first.seen + rest.seen == alone.seen, cut


async def test_a_rollback_restores_the_iterator_and_moves_it_past_the_divergence(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    pipeline = Counted()
    learner = Learner()

    def step(batch: tf.Tensor) -> dict[str, tf.Tensor]:
        learner.step(batch)
        return {"loss": tf.constant(math.nan if int(batch[0]) == 250 else 1.0)}

    sv = supervisor(logdir, learner, on_divergence=asv.Rollback(skip=1))
    async with sv.session() as sess:
        await sess.train(step, pipeline.data, epochs=1, max_steps=30)
    # Batch 25 diverged: back to the checkpoint of step 20, then on from batch 27.
    assert learner.seen[:26] == list(range(0, 260, 10))
    assert learner.seen[26:] == list(range(270, 310, 10))
    (resumed,) = named(events, "data.resumed")
    assert resumed["batch"] == 27 and resumed["advanced"] == 7


async def test_a_shuffle_without_any_seed_is_said_to_be_not_exact_once(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    def data(epoch: int) -> tf.data.Dataset:
        return tf.data.Dataset.range(ELEMENTS).shuffle(50).batch(10)

    tf.random.set_seed(None)  # no global seed (another test of this process may set one)
    await train(logdir, data, 50)
    (said,) = named(events, "data.not_exact")  # once, though two epochs were opened
    assert "seed" in said["reason"]
    events.clear()
    await train(logdir + "-seeded", lambda epoch: data(epoch).shuffle(5, seed=epoch), 5)
    assert named(events, "data.not_exact")  # the inner shuffle has none
    events.clear()
    seeded = await train(
        logdir + "-all", lambda e: tf.data.Dataset.range(9).shuffle(9, seed=e).batch(3), 5
    )
    assert seeded.seen and not named(events, "data.not_exact")


@ONE_LOOP
async def test_a_data_state_that_holds_an_in_memory_cache_is_said_to_be_large_once(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """An in-memory ``cache()`` is in TF's state of the iterator whole, and so in every
    checkpoint: a run saving every few seconds writes the cache each time. Said once a
    session, with the size and what to do; a pipeline that only buffers a little is not."""

    def wide(cached: bool) -> tf.data.Dataset:
        def row(i: tf.Tensor) -> tf.Tensor:  # noise: TF compresses the state it saves
            return tf.random.stateless_uniform([2048], seed=tf.stack([i, tf.constant(0, tf.int64)]))

        # 800 KiB a batch: from the save at step 30 on, every save's state is over 16 MiB
        # however far TF has read ahead.
        batches = tf.data.Dataset.range(5000).map(row).batch(100)
        return batches.cache() if cached else batches

    v = tf.Variable(0.0)

    def step(batch: tf.Tensor) -> tf.Tensor:
        v.assign_add(batch[0, 0])
        return v

    async def run(logdir: str, cached: bool) -> None:
        sv = asv.Supervisor(
            logdir,
            checkpoint={"v": v},
            save_model_steps=10,  # 10 batches: 8 MiB of cache more at each save
            save_model_secs=0,
            save_summaries_secs=0,
            handle_signals=False,
        )
        async with sv.session() as sess:
            await sess.train(step, wide(cached), epochs=1)

    await run(logdir, cached=True)
    (said,) = named(events, "data.state_large")  # once, though at least three saves held it
    assert said["mib"] >= 16 and "cache" in said["reason"]
    assert "cache(filename)" in said["hint"]
    events.clear()
    await run(logdir + "-uncached", cached=False)
    assert not named(events, "data.state_large")


@pytest.fixture
def fingerprints(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each fingerprint the session takes of a pipeline, in order (the real one, counted)."""
    from asupervisor._training import fingerprint

    taken: list[str] = []
    real = fingerprint.of_dataset

    def counted(dataset: Any) -> str:
        taken.append(real(dataset))
        return taken[-1]

    monkeypatch.setattr(fingerprint, "of_dataset", counted)
    return taken


@ONE_LOOP
async def test_a_dataset_given_once_is_fingerprinted_once_a_session_not_at_each_epoch(
    logdir: str, fingerprints: list[str]
) -> None:
    """The fingerprint of a few MB of in-memory data is tens of milliseconds: at each
    epoch's iterator it was a tenth of a small model's epoch under ``fit``. A dataset is
    immutable, so its fingerprint is taken once; an epoch function's datasets each once."""
    taken = fingerprints
    dataset = tf.data.Dataset.range(40).batch(10)
    learner = Learner()
    async with supervisor(logdir, learner).session() as sess:
        await sess.train(learner.step, dataset, epochs=3)
    assert len(learner.seen) == 12 and len(taken) == 1 and taken[0]
    taken.clear()
    learner = Learner()
    async with supervisor(logdir + "-fn", learner).session() as sess:
        await sess.train(learner.step, lambda epoch: tf.data.Dataset.range(40).batch(10), epochs=3)
    assert len(learner.seen) == 12 and len(taken) == 3 and len(set(taken)) == 1


@ONE_LOOP
@pytest.mark.parametrize("how", ["as_given", "class_weight", "steps_per_epoch"])
async def test_fit_fingerprints_a_dataset_given_once_once_however_it_reads_each_epoch(
    logdir: str, fingerprints: list[str], how: str
) -> None:
    """``fit`` reads each epoch's data through a ``map`` (class weights), or one stream over
    every epoch (``steps_per_epoch``): made once for the dataset, not each epoch, so that
    it too is fingerprinted once."""
    import keras

    taken = fingerprints
    xs = tf.data.Dataset.range(40).map(lambda i: tf.cast(i % 2, tf.float32)[None])
    data = xs.map(lambda x: (x, tf.cast(x[0], tf.int64))).batch(10)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    options: dict[str, Any] = {
        "as_given": {},
        "class_weight": {"class_weight": {0: 1.0, 1: 2.0}},
        "steps_per_epoch": {"steps_per_epoch": 2},
    }[how]
    sv = asv.Supervisor(
        logdir, checkpoint={"model": model, "opt": model.optimizer}, save_model_secs=0,
        save_model_steps=2, save_summaries_secs=0, handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.fit(model, data, epochs=3, verbose=0, **options)
    assert sess.data_position[0] == 3
    assert len(taken) == 1 and taken[0]


def stop_after(sess: asv.ManagedSession, batches: int) -> Any:
    """A Keras callback that stops the session after ``batches`` batches, as a SIGTERM."""
    import keras

    class StopAfter(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.left = batches

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.left -= 1
            if self.left == 0:
                sess.request_stop(reason=asv.StopReason.SIGNAL)

    return StopAfter()


async def test_fit_resumes_inside_an_epoch_computing_no_batch_before_it(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    import keras

    pipeline = Counted()

    def data(epoch: int) -> tf.data.Dataset:
        numbers = pipeline.data(epoch).map(lambda b: tf.cast(b, tf.float32)[:, None])
        return numbers.map(lambda x: (x, 2.0 * x))

    async def fit(batches: int) -> tuple[int, int]:
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        sv = asv.Supervisor(
            logdir, checkpoint={"model": model, "opt": model.optimizer}, save_model_secs=0,
            save_model_steps=1000, save_summaries_secs=0, handle_signals=False,
        )  # fmt: skip
        async with sv.session() as sess:
            await sess.fit(model, data, epochs=2, callbacks=[stop_after(sess, batches)], verbose=0)
        return sess.data_position

    assert await fit(30) == (0, 30)
    pipeline.computed.assign(0)
    assert await fit(1) == (0, 31)
    assert int(pipeline.computed.numpy()) < 50  # not the 300 elements before batch 30
    (resumed,) = named(events, "data.resumed")
    assert resumed["batch"] == 30


class Every(Learner):
    """Records every element of each batch it trains."""

    def step(self, batch: tf.Tensor) -> dict[str, tf.Tensor]:
        self.seen.extend(int(x) for x in batch)
        self.v.assign_add(1.0)
        return {"loss": tf.constant(1.0)}


async def train_every(logdir: str, data: Any, steps: int, epochs: int = 1) -> Every:
    learner = Every()
    async with supervisor(logdir, learner, save_model_steps=1).session() as sess:
        await sess.train(learner.step, data, epochs=epochs, max_steps=steps)
    return learner


def shuffled(numbers: range, buffer: int = 40, batch: int = 4) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(list(numbers)).shuffle(buffer, seed=3).batch(batch)


@ONE_LOOP
async def test_a_batch_size_changed_between_sessions_resumes_by_skip_and_says_so(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    first = await train_every(logdir, shuffled(range(40)), 3)  # 12 examples, batches of 4
    assert len(first.seen) == 12
    again = await train_every(logdir, shuffled(range(40), batch=8), 10)
    # The position (batch 3) is a batch of the pipeline given now: its batches 3 and 4.
    assert again.seen == [int(x) for b in shuffled(range(40), batch=8).skip(3) for x in b]
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["reason"] == "the pipeline changed" and skip["batches"] == 3
    assert not named(events, "data.resumed")


@ONE_LOOP
async def test_fit_with_a_batch_size_changed_between_sessions_says_the_pipeline_changed(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    import keras

    def data(batch: int) -> tf.data.Dataset:
        numbers = tf.data.Dataset.from_tensor_slices([float(i) for i in range(40)])
        return numbers.shuffle(40, seed=3).batch(batch).map(lambda x: (x[:, None], x[:, None]))

    async def fit(batch: int, stop: int) -> tuple[int, int]:
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        sv = asv.Supervisor(
            logdir, checkpoint={"model": model}, save_model_secs=0, save_model_steps=1000,
            save_summaries_secs=0, handle_signals=False,
        )  # fmt: skip
        async with sv.session() as sess:
            callbacks = [stop_after(sess, stop)]
            await sess.fit(model, data(batch), epochs=1, callbacks=callbacks, verbose=0)
        return sess.data_position

    assert await fit(4, 3) == (0, 3)
    assert await fit(8, 100) == (1, 0)  # the epoch's batches 3 and 4 of 8 examples
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["reason"] == "the pipeline changed" and skip["batches"] == 3
    assert not named(events, "data.resumed")


@ONE_LOOP
async def test_a_shuffle_buffer_changed_between_sessions_resumes_by_skip_not_a_crash(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    await train_every(logdir, shuffled(range(40), buffer=20), 3)
    again = await train_every(logdir, shuffled(range(40), buffer=5), 10)
    assert again.seen == [int(x) for b in shuffled(range(40), buffer=5).skip(3) for x in b]
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["reason"] == "the pipeline changed"


@ONE_LOOP
async def test_data_changed_between_sessions_is_read_anew_never_the_old_data(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    await train_every(logdir, shuffled(range(0, 40)), 3)
    again = await train_every(logdir, shuffled(range(100, 140)), 10)
    assert len(again.seen) == 28 and all(x >= 100 for x in again.seen)
    (skip,) = named(events, "data.resume_by_skip")
    assert skip["reason"] == "the pipeline changed"
    (changed,) = named(events, "run.changed")
    assert changed["changed"] == ["the data pipeline of epoch 0"]


@ONE_LOOP
async def test_the_same_pipeline_built_again_restores_its_state(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """Built anew by each session (its functions traced again, its seed generator and
    captured variables made again): the same fingerprint, the state restored."""
    counted = Counted()
    first = await train_every(logdir, counted.data(0).map(lambda b: b * 2), 3)
    again = await train_every(logdir, Counted().data(0).map(lambda b: b * 2), 2)
    assert first.seen[-1] == 58 and again.seen[0] == 60
    assert named(events, "data.resumed") and not named(events, "data.resume_by_skip")


def test_a_pipelines_fingerprint_is_its_graph_and_sources_not_what_tf_makes_up_per_build() -> None:
    from asupervisor._training.fingerprint import of_dataset

    counter = tf.Variable(0, dtype=tf.int64)

    def pipeline(start: int = 0, buffer: int = 20, batch: int = 4) -> tf.data.Dataset:
        def count(i: tf.Tensor) -> tf.Tensor:
            counter.assign_add(1)
            return i + tf.random.uniform((), maxval=2, dtype=tf.int64)

        numbers = tf.data.Dataset.range(start, start + 40).map(count).map(lambda i: i * 2)
        return numbers.shuffle(buffer).batch(batch).prefetch(2)

    first = of_dataset(pipeline())
    assert first.startswith("p1:")
    for _ in range(3):  # other traces, other random ops: TF's counters move on
        tf.random.uniform(())
        tf.data.Dataset.range(3).map(lambda i: i + 1)
    counter.assign(17)  # a captured variable's value is state, not the pipeline
    assert of_dataset(pipeline()) == first
    changed = {of_dataset(pipeline(start=100)), of_dataset(pipeline(buffer=5))}
    changed.add(of_dataset(pipeline(batch=8)))
    assert first not in changed and len(changed) == 3
    assert of_dataset([1, 2, 3]) == ""  # not tf.data: nothing to say


def test_a_save_after_a_restore_writes_the_position_even_where_the_last_save_held_it() -> None:
    """A save assigns only what moved since the last one; a restore writes the variables
    behind its back, so the next save assigns again, even a position equal to the one the
    save before the restore wrote."""
    from asupervisor._training.position import Position

    position = Position()
    position.go_to(1, 3)
    position.keep_logs({"loss": 0.5})
    position.sync()
    position.sync()  # nothing moved: nothing to assign
    saved = position.place.json
    written = saved.numpy().decode()
    assert json.loads(written)["epoch"] == 1 and json.loads(written)["batch"] == 3
    moved = {"epoch": 7, "batch": 0, "epoch_batches": 0, "stopped": False, "logs": {}}
    saved.assign(json.dumps(moved))  # what a restore writes
    position.reload()
    assert (position.epoch, position.batch, position.logs) == (7, 0, {})
    position.go_to(1, 3)  # back where the last save was (a rollback's move, say)
    position.keep_logs({"loss": 0.5})
    position.sync()
    assert saved.numpy().decode() == written
