"""The iterator training reads, and its state in every checkpoint: a resume at any batch
in constant time.

``Dataset.skip(n)`` reaches batch n by computing the n batches before it again: with a
costly input pipeline, hours after a long run. TensorFlow can serialize a ``tf.data``
iterator instead (its sources' positions, its buffers, its shuffle seeds); each save
holds that state, taken at the same step boundary as the rest, and a resumed run
restores it into an iterator of the same pipeline and reads on from there.

- **One owner.** The training thread opens, reads, saves and closes the iterator, only
  through this module's ``Reader`` (owned by the session's ``Position``).
- **What a checkpoint holds** (``data_iterator``): the serialized state as strings, and
  a JSON record of where it is: the pipeline it belongs to (its key: the epoch, or the
  one stream of ``fit(steps_per_epoch=)``), the batches ``Dataset.skip`` skipped when it
  was opened, the batch it has reached, the data position at the save (a record
  that does not name the restored position is stale and never used), and the pipeline's
  fingerprint (``fingerprint``: its graph and its sources).
- **Only into its own pipeline.** A state is restored only into a pipeline of the same
  fingerprint: one edited between two sessions (a batch size, a shuffle's buffer, the
  data) is read from the restored position by ``Dataset.skip``, said once
  (``data.resume_by_skip``, reason "the pipeline changed").
- **Restored in place.** Asked for batch b of a pipeline whose saved state is at batch
  a <= b (a rollback moves the position past the batches that diverged), the state is
  restored and the iterator advanced b - a batches.
- **The fallback** is ``Dataset.skip``: where no state can be saved (data that is not
  ``tf.data``, a distributed dataset, a multi-worker job, a pipeline TF cannot serialize:
  ``py_function``, ``from_generator``), or the checkpoint has none (an older one). It
  is logged once, with what it costs (``data.resume_by_skip``: the batches computed
  again).
- **One iteration per epoch.** Asked again for the place the open iterator is at (Keras
  opens the next epoch's iterator at the end of each epoch, and again at its start), the
  same iterator is given back: each epoch's data is iterated once, so a reshuffling
  ``shuffle`` gives an epoch the same order whether or not the run was interrupted.
- **One dataset for every epoch** (not a function of the epoch): a reshuffling
  ``shuffle`` draws each iteration's order from the dataset's seed generator, so a
  resumed run first makes (and never reads) the iterators the epochs before made.
- **The seed generators as the run left alone has them.** A state holds a shuffle's
  seed count only while the shuffle is still read; a restore of one taken later (a
  prefetch runs ahead to the epoch's end at its own pace) would leave the next epoch's
  order one draw on, so at a resume the counts a new iterator has are set again after
  the restore.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._log import log
from . import fingerprint
from .release import release

NAME = "data_iterator"  # its name in the checkpoint
FORMAT = 1
CHANGED = "the pipeline changed"  # the reason a saved state is not restored into another
STREAM = -1  # the key of fit's one stream over every epoch (steps_per_epoch over a dataset)
# A state this large is said once a session (``data.state_large``): it is written with
# every checkpoint, and TF's state holds the pipeline's buffers whole (an in-memory
# ``cache()`` all of it), which a run saving every few seconds pays at each save.
LARGE_STATE = 16 * 2**20


@dataclass(frozen=True)
class Saved:
    """An iterator's state as a checkpoint holds it (``state``: ``None`` when none could
    be taken, and ``why``)."""

    key: int
    skip: int
    at: int
    spec: str
    state: Any = None
    why: str = ""
    pipeline: str = ""  # the pipeline's fingerprint ("" not known: see ``fingerprint``)


class Opened:
    """The iterator open now, and where it is."""

    def __init__(
        self,
        iterator: Any,
        key: int,
        skip: int,
        at: int,
        count: int,
        spec: str,
        why: str,
        ended: Saved | None = None,
        pipeline: str = "",
    ) -> None:
        self.iterator = iterator
        self.pipeline = pipeline
        self.ended = ended  # at its pipeline's end: nothing to read, the state as restored
        self.key, self.skip, self.spec = key, skip, spec
        self.at_open, self.count_at_open = at, count
        self.why = why  # why its state cannot be saved ("" if it can)
        self.fetched = 0  # batches taken through ``Counted`` (train), -1: not counted (fit)

    def at(self, count: int) -> int:
        return self.at_open + count - self.count_at_open

    def handed_out(self, counted: bool) -> None:
        self.fetched = 0 if counted else -1

    def took_one(self) -> None:
        self.fetched += 1

    def took(self, batches: int) -> None:
        self.fetched += batches

    def unsaveable(self, why: str) -> None:
        self.why = why

    def consistent(self, count: int) -> bool:
        """Whether its state is at the batch the position counted (not when a batch was
        fetched and its step failed)."""
        return self.fetched < 0 or self.fetched == self.at(count) - self.at_open


class Counted:
    """An iterator that counts what it hands out: a batch fetched whose step then failed
    is in the iterator's state but not in the position, and such a state is not kept."""

    def __init__(self, opened: Opened) -> None:
        self._next = opened.iterator.__next__
        self._opened = opened
        opened.handed_out(True)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = self._next()
        self._opened.took_one()
        return batch

    @property
    def raw(self) -> Any:
        """The iterator itself, for a loop that reads it inside a ``tf.function``."""
        return self._opened.iterator

    def took(self, batches: int) -> None:
        """``batches`` were read from ``raw`` (inside a ``tf.function``)."""
        self._opened.took(batches)


class Reader:
    """The session's one reader of the data (training thread)."""

    def __init__(self) -> None:
        import tensorflow as tf

        module = tf.Module(name=NAME)
        module.state = tf.Variable("", dtype=tf.string, trainable=False, name="state")
        module.meta = tf.Variable("", dtype=tf.string, trainable=False, name="meta")
        self.module = module
        self.count = 0  # batches counted by the position since the session began
        self.current: Opened | None = None
        self.kept: Saved | None = None  # restored and not used yet, or taken at a close
        self._told: set[str] = set()  # what has been logged once
        self._why = ""  # why the last state restored did not fit (for the fallback's log)
        self._iterations: dict[int, int] = {}  # iterators made of one dataset (_catch_up)
        self._read: set[int] = set()  # the datasets of _iterations this session has read
        self._synced: str | None = None  # "": the last sync assigned no state (None: unknown)
        # Each dataset's fingerprint, by the dataset (immutable: its graph is fixed): taken
        # once, not at each epoch's iterator, where it is tens of milliseconds for a few MB
        # of in-memory data. By id, checked by a weak reference: an id can be reused.
        self._fingerprints: dict[int, tuple[weakref.ref[Any], str]] = {}

    # -- reading ---------------------------------------------------------------------

    def open(
        self,
        key: int,
        at: int,
        build: Callable[[int], Iterable[Any]],
        *,
        saveable: str = "",
        same_data: Any = None,
        counted: bool = False,
    ) -> Iterator[Any]:
        """An iterator of pipeline ``key`` at its batch ``at``. ``build(skip)`` makes the
        pipeline with its first ``skip`` batches skipped (``Dataset.skip``); ``saveable``
        says why no state may be saved or restored here ("" if it may); ``same_data``:
        the dataset every epoch reads, when it is one object (see ``_catch_up``);
        ``counted``: the caller takes every batch through the iterator returned (not fit,
        where Keras reads the iterator inside its graph)."""
        current = self.current
        if current is not None and current.key == key and current.at(self.count) == at:
            if current.fetched <= 0:  # nothing taken from it yet (or not counted): as new
                return self._hand_out(current, counted)
        self._drop()
        one = same_data is not None and key >= 0
        if one:
            self._catch_up(same_data, key, build)
        # The first iterator this session reads of the one dataset: the seed generators'
        # counts of a new one are the run left alone's here (see ``_set_seed_counts``).
        first = one and id(same_data) not in self._read
        saved, self.kept = self.kept, None
        opened = None
        if saved is not None and not saveable:
            opened = self._restore(saved, key, at, build, one, first)
        if opened is None:
            opened = self._fresh(saved, key, at, build, saveable)
        if one and opened.ended is None:
            self._iterations[id(same_data)] += 1
            self._read.add(id(same_data))
        self.current = opened
        return self._hand_out(opened, counted)

    def _catch_up(self, data: Any, epoch: int, build: Callable[[int], Iterable[Any]]) -> None:
        """One dataset for every epoch: a reshuffling ``shuffle`` draws each iteration's
        order from its seed generator, so epoch e must be its (e+1)-th iteration here
        too, as in the run left alone (one an epoch). Iterators are made until it is
        (never read: no element is computed)."""
        made = self._iterations.setdefault(id(data), 0)
        for _ in range(epoch - made):
            release(iter(build(0)))
        self._iterations[id(data)] = max(made, epoch)

    def iterated(self, data: Any) -> None:
        """``data`` (the dataset every epoch reads) was iterated once besides the epochs
        (Keras' build under a strategy): counted, as every run does it."""
        self._iterations[id(data)] = self._iterations.get(id(data), 0) + 1

    def _hand_out(self, opened: Opened, counted: bool) -> Iterator[Any]:
        if counted:
            return Counted(opened)
        opened.handed_out(False)
        return opened.iterator  # type: ignore[no-any-return]

    def _restore(
        self,
        saved: Saved,
        key: int,
        at: int,
        build: Callable[[int], Iterable[Any]],
        same_data: bool,
        first: bool = False,
    ) -> Opened | None:
        """The saved state restored into a new iterator of the pipeline, or ``None``;
        ``first``: the first iterator this session reads of the one dataset."""
        if saved.state is None or saved.key != key or saved.at > at:
            return None
        if same_data and _ended(build(0), at):
            # Nothing is left to read, and TF's state of a shuffle at its very end would
            # set the dataset's seed generator one draw on: the next epoch's order would
            # differ. Not restored; the next epoch is caught up by counting instead.
            return Opened(iter(()), key, saved.skip, at, self.count, saved.spec, "", saved)
        source = build(saved.skip)
        self._check_exact(source)
        pipeline = self._fingerprint(source)
        if saved.pipeline and pipeline and pipeline != saved.pipeline:
            # Another pipeline (a batch size, a buffer, the data edited): TF's state of the
            # old one would read on at the wrong place, or the old data, or fail inside
            # IteratorGetNext at every restart. Not restored: the position is reached by
            # skipping in the pipeline given now.
            self._why = CHANGED
            which = f"of epoch {key}" if key >= 0 else "of fit's stream over every epoch"
            log.warning("run.changed", changed=[f"the data pipeline {which}"], hint=None)
            return None
        iterator = iter(source)
        spec = _spec(source)
        try:
            if spec != saved.spec:
                raise ValueError(f"its elements are {spec}, the saved state's {saved.spec}")
            counts = _state_of(iterator) if first else None  # the counts at the epoch's start
            _restore_state(iterator, saved.state)
            if counts is not None:
                _set_seed_counts(source, counts)
            for _ in range(at - saved.at):
                next(iterator)
        except Exception as exc:  # another pipeline than the one saved: read it anew
            release(iterator)
            self._why = f"the saved state does not fit the pipeline: {_first_line(exc)}"
            return None
        log.info("data.resumed", key=key, batch=at, advanced=at - saved.at)
        return Opened(iterator, key, saved.skip, at, self.count, saved.spec, "", None, pipeline)

    def _fresh(
        self,
        saved: Saved | None,
        key: int,
        at: int,
        build: Callable[[int], Iterable[Any]],
        saveable: str,
    ) -> Opened:
        """A new iterator at ``at``, by ``Dataset.skip``; the fallback says what it costs."""
        why = self._why or saveable or _unsaved(saved)
        self._why = ""
        source = build(at)
        self._check_exact(source)
        iterator = iter(source)
        cannot = saveable or _cannot_save(iterator)
        if cannot:
            self._tell_not_saveable(cannot)
        if at > 0:
            log.warning(
                "data.resume_by_skip",
                key=key,
                batches=at,
                reason=why or "the checkpoint holds no state of this pipeline",
                cost=f"the {at} batches before it are computed again (Dataset.skip)",
            )
        pipeline = "" if cannot else self._fingerprint(source)
        return Opened(iterator, key, at, at, self.count, _spec(source), cannot, None, pipeline)

    def _fingerprint(self, source: Any) -> str:
        """``fingerprint.of_dataset(source)``, taken once for each dataset object."""
        known = self._fingerprints.get(id(source))
        if known is not None and known[0]() is source:
            return known[1]
        taken = fingerprint.of_dataset(source)
        try:
            ref = weakref.ref(source)
        except TypeError:  # not weakly referable: taken each time
            return taken
        # The dead ones out first: a run of many epoch functions' datasets stays small.
        for key in [k for k, (r, _) in self._fingerprints.items() if r() is None]:
            del self._fingerprints[key]
        self._fingerprints[id(source)] = (ref, taken)
        return taken

    def _check_exact(self, source: Any) -> None:
        """Once a session: a shuffle with no seed at all orders each run its own way, so a
        resumed run reads other batches than the run left alone would."""
        if "not_exact" not in self._told and _unseeded_shuffle(source):
            self._told.add("not_exact")
            log.warning(
                "data.not_exact",
                reason="a shuffle without a seed (and no global seed): a resumed run reads "
                "other batches than the run left alone; give shuffle() a seed",
            )

    def _check_size(self, state: Any) -> None:
        """Once a session: a state large enough to weigh on every save, and what to do."""
        if "large" in self._told:
            return
        import tensorflow as tf

        size = int(tf.strings.length(state))  # one op at a save: no copy of the state
        if size < LARGE_STATE:
            return
        self._told.add("large")
        log.warning(
            "data.state_large",
            mib=round(size / 2**20, 1),
            reason="TF's state of the data iterator, written with every checkpoint, holds "
            "the pipeline's buffers whole: an in-memory cache() all of it, a shuffle()'s "
            "buffer, the elements computed ahead",
            hint="cache to a file (cache(filename): its state is a position), shuffle file "
            "names or indices before the costly map(), or a smaller shuffle buffer",
        )

    def _tell_not_saveable(self, why: str) -> None:
        """Once a session: a resume inside an epoch will replay its batches, and why."""
        if why not in self._told:
            self._told.add(why)
            log.info("data.not_saveable", reason=why, resume="by Dataset.skip")

    def pipeline(self) -> str:
        """The fingerprint of the pipeline read now, or of the state kept ("": none)."""
        if self.current is not None:
            return self.current.pipeline
        return self.kept.pipeline if self.kept is not None else ""

    def advance(self, batches: int) -> None:
        """The position counted ``batches`` more (read from the iterator open now)."""
        self.count += batches

    def close(self, *, clean: bool) -> None:
        """Done with the iterator open now: its state is kept for the saves to come (the
        final one) when ``clean`` (at a step boundary, every batch fetched counted), and
        the iterator is let go off this thread (its destructor may block)."""
        opened, self.current = self.current, None
        if opened is None:
            return
        if clean and opened.consistent(self.count):
            self.kept = self._taken(opened)
        release(opened.iterator)

    def _drop(self) -> None:
        opened, self.current = self.current, None
        if opened is not None:
            release(opened.iterator)

    # -- the checkpoint --------------------------------------------------------------

    def objects(self) -> dict[str, Any]:
        return {NAME: self.module}

    def sync(self, position: tuple[int, int]) -> None:
        """Training thread, before a save: the state of the iterator open now (or the one
        kept) into the checkpoint, with where it is."""
        opened = self.current
        saved = self._taken(opened) if opened is not None else self.kept
        if saved is None:
            if self._synced != "":  # no iterator at the last save either: nothing to assign
                self.module.meta.assign("")
                self.module.state.assign(_no_state())
                self._synced = ""
            return
        meta = {
            "format": FORMAT,
            "position": list(position),
            "key": saved.key,
            "skip": saved.skip,
            "at": saved.at,
            "spec": saved.spec,
            "why": saved.why,
            "pipeline": saved.pipeline,
        }
        self.module.meta.assign(json.dumps(meta))
        self.module.state.assign(saved.state if saved.state is not None else _no_state())
        self._synced = None  # a state is assigned at every save that has one

    def _taken(self, opened: Opened) -> Saved:
        """The state of ``opened`` now, or why there is none."""
        if opened.ended is not None:
            return opened.ended
        at = opened.at(self.count)
        why = opened.why
        if not why:
            try:
                state = _state_of(opened.iterator)
            except Exception as exc:
                why = f"TensorFlow cannot save its state: {_first_line(exc)}"
                opened.unsaveable(why)
                self._tell_not_saveable(why)
            else:  # the size is looked at outside the try: its errors are no unsaveable state
                self._check_size(state)
                return Saved(opened.key, opened.skip, at, opened.spec, state, "", opened.pipeline)
        return Saved(opened.key, opened.skip, at, opened.spec, None, why, opened.pipeline)

    def reload(self, position: tuple[int, int]) -> None:
        """After a restore (or a fresh start): the state the checkpoint holds is kept for
        the next ``open``; the iterator open now is of the state restored over."""
        self._synced = None  # the restore wrote the variables
        self._drop()
        self.kept = None
        self._why = ""
        try:
            meta = json.loads(self.module.meta.numpy().decode() or "null")
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return  # none (a fresh start, an older checkpoint): skip, if need be
        if meta.get("position") != list(position):
            return  # of another save than the one restored (see the docstring)
        import tensorflow as tf

        state = self.module.state.read_value()
        self.kept = Saved(
            int(meta["key"]),
            int(meta["skip"]),
            int(meta["at"]),
            str(meta.get("spec", "")),
            state if int(tf.strings.length(state)) else None,
            str(meta.get("why", "")),
            str(meta.get("pipeline", "")),  # none in an older checkpoint: not checked
        )


def _unsaved(saved: Saved | None) -> str:
    """Why the checkpoint holds no state (what the run that saved it knew)."""
    return saved.why if saved is not None and saved.state is None else ""


def _unseeded_shuffle(source: Any) -> bool:
    """Whether a ``tf.data`` pipeline holds a ``shuffle`` seeded neither by its call nor by
    a global seed (TF keeps both seeds 0 then: drawn at random)."""
    seen: set[int] = set()
    found = [source]
    while found:
        dataset = found.pop()
        if id(dataset) in seen:
            continue
        seen.add(id(dataset))
        if type(dataset).__name__ == "_ShuffleDataset":
            seeds = (getattr(dataset, "_seed", None), getattr(dataset, "_seed2", None))
            if all(seed is not None and int(seed) == 0 for seed in seeds):
                return True
        inputs = getattr(dataset, "_inputs", None)
        if callable(inputs):
            try:
                found.extend(inputs())
            except Exception:  # not a pipeline TF can walk: nothing to say
                continue
    return False


def _ended(source: Any, at: int) -> bool:
    """Whether batch ``at`` is past the end of ``source`` (when its length is known)."""
    cardinality = getattr(source, "cardinality", None)
    length = int(cardinality()) if cardinality is not None else -1
    return 0 <= length <= at


def _spec(source: Any) -> str:
    spec = getattr(source, "element_spec", None)
    return repr(spec)


def _cannot_save(iterator: Any) -> str:
    """Why TF cannot save this iterator's state ("" if it can): tried on the new iterator,
    which costs little (no buffer is filled yet)."""
    import tensorflow as tf

    if not isinstance(iterator, tf.data.Iterator) or not hasattr(iterator, "_serialize_to_tensors"):
        kind = type(iterator).__name__
        if "Distributed" in kind:
            return "a distributed dataset (tf.distribute): TensorFlow cannot save its iterator"
        return f"not a tf.data pipeline ({kind}): only tf.data iterators have a state to save"
    try:
        _state_of(iterator)
    except Exception as exc:  # a py_function, a generator: TF says which
        return f"TensorFlow cannot save its state: {_first_line(exc)}"
    return ""


def _state_of(iterator: Any) -> Any:
    """The iterator's state as one string: TF's serialized state (the one its own
    checkpoints save, a vector of variants), each part a serialized tensor."""
    import tensorflow as tf

    state = iterator._serialize_to_tensors()["_STATE"]
    parts = tf.stack([tf.io.serialize_tensor(part) for part in tf.unstack(state)])
    return tf.io.serialize_tensor(parts)


def _restore_state(iterator: Any, state: Any) -> None:
    import tensorflow as tf

    parts = tf.io.parse_tensor(state, tf.string)
    variants = [tf.io.parse_tensor(part, tf.variant) for part in tf.unstack(parts)]
    iterator._restore_from_tensors({"_STATE": tf.stack(variants)})


def _set_seed_counts(source: Any, counts: Any) -> None:
    """The pipeline's seed generators set to the counts of the state ``counts``, taken of
    a new iterator (its shuffles not read yet, so their counts are in it). A saved state
    holds a shuffle's count only while its iterator still reads the shuffle: one taken
    after the pipeline read the shuffle to its end (a prefetch running ahead of training
    does, at its own pace) holds none, and restoring it leaves the count one draw on, by
    the iterator the restore makes. Restored into an iterator of its own, the new one's
    state sets the counts again; that iterator is never read. Only at the first iterator
    a session reads of the dataset: after a rollback this session has made more, and a
    new iterator's counts are not the epoch's."""
    other = iter(source)
    try:
        _restore_state(other, counts)
    finally:
        release(other)


def _no_state() -> Any:
    import tensorflow as tf

    return tf.constant("", tf.string)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[-1] if text else type(exc).__name__
    return line[:300]
