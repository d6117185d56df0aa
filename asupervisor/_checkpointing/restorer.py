"""Restore with fallback: the newest checkpoint of the history that reads back whole.

Runs on the training thread. The order is the history's (``_history.Catalog.candidates``):
a chief first tries complete checkpoints a kill left uncommitted (newer than the head),
then the head and the commits it descends from, newest first; a reader beside a live
chief only what is committed. Never an abandoned commit. What cannot be read is skipped,
logged (``checkpoint.fallback``) and reported; what the chief restored becomes the head:
an uncommitted one is adopted, and a fallback past a damaged head is recorded.
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import CheckpointMismatchError
from .._log import log
from .._logdir.catalog import Catalog
from .._logdir.files import checkpoint_problem, delete_checkpoint, files_problem, index_torn
from .._logdir.lock import WriteGuard
from .._logdir.store import Store
from .._logdir.verify import (
    shape_differences,
    top_level_differences,
    variable_differences,
    verify_checkpoint,
)
from .root import GLOBAL_STEP, OWN_PARTS, SavedRoot

VANISHED_RETRIES = 100  # passes over the logdir while the chief's sweep removes what we chose


def _vanished_text(problem: str) -> bool:
    """A verification that failed on missing files (swept meanwhile, perhaps)."""
    return problem.startswith("NotFoundError") or "not find any matching files" in problem


def _vanished(exc: BaseException) -> bool:
    """A read failed because the files are gone (TF's NotFoundError), not damaged."""
    import tensorflow as tf

    return isinstance(exc, (tf.errors.NotFoundError, FileNotFoundError))


class Restorer:
    """Restores one session's root from the checkpoints its catalog names."""

    def __init__(self, root: SavedRoot, catalog: Catalog, guard: WriteGuard) -> None:
        self.root = root
        self.catalog = catalog
        self.store: Store = catalog.store
        self.chief = guard.lock is not None  # the one writer: it may adopt and record
        # Every change to the logdir enters the guard: a restore the session gave up on
        # (a stop during start-up) goes on by itself, and must write nothing once the
        # session has closed and released the lock (``Fenced`` then ends it).
        self.guard = guard
        self.restore_status: Any = None
        self.migrated = False  # the last restore was of another tool's checkpoint
        self._verified: dict[tuple[str, float | None], bool] = {}  # for good_exists()

    def candidates(self) -> list[str]:
        """What a restore tries, in order (full paths)."""
        # The chief (lock holder) is the only writer: every complete file is its own.
        # Anyone else reads beside a live writer, and trusts only what is committed.
        self.catalog.reload()
        return [self.store.path(n) for n in self.catalog.candidates(committed_only=not self.chief)]

    def restore_newest(self) -> tuple[str | None, list[tuple[str, str]]]:
        """Restore the newest checkpoint that reads back whole; skip the damaged ones.

        Returns the path restored (``None`` if there was none) and the skipped
        checkpoints with their reasons. A readable checkpoint that does not match
        the model raises ``CheckpointMismatchError``: that is a wrong model or a
        wrong logdir, not damage, and no older checkpoint would fix it.
        """
        damaged = self.catalog.damaged_state
        skipped: list[tuple[str, str]] = [damaged] if damaged else []
        for name in self.catalog.listed_without_files():
            self._skip(skipped, self.store.path(name), "its .index file is gone")
        failed: set[str] = set()  # failed once while the logdir changed: damage if again
        for _ in range(VANISHED_RETRIES):
            path, vanished = self._restore_first_good(skipped, failed)
            if not vanished:
                return path, skipped
        # The logdir never held still: one last pass in which every failure is damage.
        path, _ = self._restore_first_good(skipped, set(self.candidates()))
        return path, skipped

    def _skip(self, skipped: list[tuple[str, str]], path: str, problem: str) -> None:
        if path not in (p for p, _ in skipped):  # once, however many passes
            log.warning("checkpoint.fallback", skipped=path, reason=problem)
            skipped.append((path, problem))

    def _restore_first_good(
        self, skipped: list[tuple[str, str]], failed: set[str]
    ) -> tuple[str | None, bool]:
        """One pass over the candidates; ``(None, True)`` when one failed because the
        logdir changed under it (the chief's retention swept it mid-read): the caller
        lists again, newer ones first. Failing a second time, it is damage."""
        passed = {p for p, _ in skipped}
        candidates = self.candidates()
        names = self.store.names()  # one listing for the pass's checks, not one each
        for path in candidates:
            if path in passed:
                continue
            problem = checkpoint_problem(self.store, path, names)
            try:
                if problem is None:
                    self.restore(path)
            except Exception as exc:
                # Files swept away in the middle of a restore fail it in several ways (a
                # NotFoundError, or objects left unbound): gone is gone, not damage. A
                # mismatch stands only if the checkpoint is still there, whole.
                if not _vanished(exc) and not self._gone(path) and verify_checkpoint(path) is None:
                    raise
                problem = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            if problem is not None and path not in failed:
                if _vanished_text(problem) or self._gone(path):
                    failed.add(path)
                    log.info("checkpoint.vanished", path=path, reason=problem)
                    return None, True  # listed again: newer ones first
            if problem is None:
                if self.chief:
                    self._settle(path, skipped)
                    if self.migrated:
                        self._mark_foreign()
                return path, False
            self._skip(skipped, path, problem)
            self._remove_if_torn(path, problem)
        return None, False

    def _remove_if_torn(self, path: str, problem: str) -> None:
        """A damaged checkpoint no commit names whose ``.index`` is empty or short is a
        write a kill cut short (TF's saver may leave an empty ``.index``): the chief
        removes it, or it would stay for ever (once the head is past it, no restore or
        sweep looks at it again). Any other failure to read it (EIO, EACCES, a store with
        lagging visibility) is no evidence of a torn write: it is skipped and left alone.
        Committed ones stay: they are the run's record, skipped with their reason."""
        name = os.path.basename(path)
        if not self.chief or self.catalog.history.by_name(name) is not None:
            return
        if not index_torn(self.store, name):
            return
        with self.guard.writing():
            if delete_checkpoint(self.store, name):
                log.warning("checkpoint.torn_removed", path=path, reason=problem)

    def _settle(self, path: str, skipped: list[tuple[str, str]]) -> None:
        """The chief restored ``path``: it is the head from now on. One a kill left
        uncommitted is adopted with the uncommitted ones older than it (so that retention
        sweeps them); a fallback past the head (damaged) is recorded, leaving it behind."""
        catalog, name = self.catalog, os.path.basename(path)
        history = catalog.history
        commit = history.by_name(name)
        if commit is None:  # an orphan (newest first): it and the older ones, oldest first
            orphans = catalog.orphans()
            with self.guard.writing():
                catalog.adopt(orphans[orphans.index(name) :][::-1])
        elif commit.seq != history.head:
            why = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped)[:500]
            with self.guard.writing():
                catalog.roll_back(commit.seq, kind="fallback", reason=why or "the head was skipped")

    def _mark_foreign(self) -> None:
        """A migration from checkpoints whose names look like the supervisor's own: the
        commits no session made that lack the global step are another tool's (foreign:
        restored from, never swept, their number not a step)."""
        children = {GLOBAL_STEP: self.root.children()[GLOBAL_STEP]}
        foreign = []
        for commit in self.catalog.history.committed():
            if commit.foreign or commit.session is not None:
                continue
            try:
                missing, _ = top_level_differences(children, self.store.path(commit.name))
            except Exception:  # unreadable: not known to be another tool's
                continue
            if GLOBAL_STEP in missing:
                foreign.append(commit.seq)
        if foreign:
            with self.guard.writing():
                self.catalog.mark_foreign(foreign)

    def _gone(self, path: str) -> bool:
        """Whether ``path`` is no longer a candidate, or its files are gone."""
        return path not in self.candidates() or files_problem(self.store, path) is not None

    def good_exists(self) -> bool:
        """Whether a checkpoint that reads back whole is here (what a waiting non-chief
        waits for: damaged ones do not count). Each is verified once."""
        for path in self.candidates():
            key = (path, self._stamp(path))
            if key not in self._verified:
                self._verified[key] = checkpoint_problem(self.store, path) is None
            if self._verified[key]:
                return True
        return False

    def _stamp(self, path: str) -> float | None:
        try:
            return self.store.mtime(os.path.basename(path) + ".index")
        except OSError:
            return None

    def restore(self, path: str) -> None:
        """Restore ``path`` into the root's objects, or raise CheckpointMismatchError.

        A checkpoint the supervisor did not write (``tf.train.CheckpointManager``'s
        ``ckpt-1``, ``Checkpoint.save``) lacks the global step, whatever its name (with
        ``checkpoint_basename="ckpt"`` the manager's names look like the supervisor's
        own): that is a migration (``migrated``), and the step stays as it is; every
        checkpoint the supervisor writes holds it. ``restore_status`` is kept for
        ``unrestored()``.
        """
        children = self.root.children()
        missing, unexpected = top_level_differences(children, path)
        # What an older or another tool's checkpoint may lack: restored without it.
        optional = {*OWN_PARTS, GLOBAL_STEP}
        absent = [name for name in missing if name in optional]
        missing = [name for name in missing if name not in optional]
        # Only extra names: the user's checkpoint may be given them later (TF restores an
        # attribute assigned after the restore then); if none takes them by the end of the
        # first step, the session says so (SessionCheckpoints.check_deferred).
        if missing:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: "
                f"the model has {missing or 'nothing'} that the checkpoint lacks; "
                f"the checkpoint has {unexpected or 'nothing'} that the model lacks"
            )
        shapes = shape_differences(children, path)
        if shapes:
            # Named as their user knows them (a Keras variable's path), with the rest.
            listed = variable_differences(children, path) or shapes
            raise CheckpointMismatchError(mismatch_text(path, listed))
        root = self.root.checkpoint if not absent else self.root.without(absent)
        try:
            status = root.read(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as exc:  # missing objects; shapes that differ
            # TF names one variable, with its values; the user needs every difference.
            differences = variable_differences(children, path)
            if not differences:
                differences = [_first_line(exc)]
            raise CheckpointMismatchError(mismatch_text(path, differences)) from exc
        self.restore_status = status
        self.migrated = GLOBAL_STEP in absent or not self.catalog.names.is_own(path)

    def take_restore_status(self) -> Any:
        """What the restore left to take, once: for the check after the first step."""
        status, self.restore_status = self.restore_status, None
        return status


MISMATCH_HINT = (
    "the model was changed since this run's checkpoints were written: build it as it was "
    "to resume this run, or start a new run in a new logdir"
)


def mismatch_text(path: str, differences: list[str]) -> str:
    """A ``CheckpointMismatchError``'s text: each difference on a line of its own, and
    what to do."""
    lines = "".join(f"\n  {line}" for line in differences[:_SHOWN])
    if len(differences) > _SHOWN:
        lines += f"\n  ... and {len(differences) - _SHOWN} more"
    return f"checkpoint {path} does not match the model:{lines}\n{MISMATCH_HINT}"


_SHOWN = 20  # differences listed in full


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
