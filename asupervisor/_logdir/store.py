"""The logdir as a store of files, on any file system TensorFlow has (local, gs://,
ram://). Every part reads and writes the logdir through here: the checkpoints' listing,
sync and cleanup, the state file, the lock, the events file, ``asupervisor inspect``.

- **Confinement.** A file is named by its name inside the logdir, never by a path: a
  name with a separator, ``.`` or ``..`` is refused, and a path from elsewhere (the
  state file's) becomes a name only if it is directly inside the logdir.
- **Only regular files are opened.** Locally, a FIFO, a device or a symlink that leads
  out of the logdir is "other": never opened (opening a FIFO blocks until a writer
  comes), never read, reported as damage. Reads are bounded.
- **Durability.** Locally, files are fsynced and then their directory, before the state
  file names them. While TensorFlow writes a checkpoint, a write-back thread pushes its
  temporary files to disk as they grow, so the disk works while TF serializes and the
  fsync after the write finds little left to do. An object store has no fsync (an object
  is whole once its write returns); there the order of writes is what keeps a checkpoint
  whole: its files first, the state file last.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import shutil
import stat
import threading
from collections.abc import Iterable, Iterator
from typing import Literal

from .._errors import StoreUnreachableError

Kind = Literal["file", "dir", "other"]

MAX_READ = 1 << 20  # a state file or a lease is a few hundred bytes: 1 MiB is plenty
WRITE_BACK_SECS = 0.05  # how often the write-back thread flushes a growing checkpoint


def is_object_store(path: str) -> bool:
    """``gs://``, ``s3://``, ``ram://``, ``hdfs://``...: a TF file system without POSIX calls."""
    return "://" in path and not path.startswith("file://")


def no_file_system(path: str) -> str:
    """Why ``path`` cannot be a logdir when TF has no file system for its scheme, and
    what can be one instead."""
    scheme = path.split("://")[0]
    why = f"logdir {path!r}: TensorFlow has no file system for {scheme}://"
    if scheme == "s3":
        # tensorflow-io brought s3:// to TF; its last release (0.37.1) is built for TF
        # before 2.17, and its libraries fail to load on later TF (undefined symbols).
        why += " (tensorflow-io, which had it, is built for TF before 2.17 and does not load)"
    return why + "; use a local or mounted path (the bucket mounted with FUSE, NFS), or gs://"


_CHECKPOINT_FILE = re.compile(r"\.index|\.data-\d{5,}-of-\d{5,}")  # what TF writes

# TensorFlow's error codes (``tf.errors``) for a store that cannot be reached or that
# refuses the credentials: ABORTED is what its gs:// client raises once its retries are
# spent; the others, what a store or the credentials' lookup answers.
_UNREACHABLE_CODES = frozenset(
    {
        4,  # DEADLINE_EXCEEDED
        7,  # PERMISSION_DENIED
        9,  # FAILED_PRECONDITION (no credentials found)
        10,  # ABORTED
        14,  # UNAVAILABLE
        16,  # UNAUTHENTICATED
    }
)


def unreachable(path: str, error: BaseException) -> StoreUnreachableError | None:
    """``error`` as the one-line ``StoreUnreachableError`` for the logdir ``path``, if it is
    TensorFlow's error for an object store that cannot be reached (or refuses the
    credentials); ``None`` for any other error, and for a local path."""
    if not is_object_store(path) or getattr(error, "error_code", None) not in _UNREACHABLE_CODES:
        return None
    reason = " ".join(str(getattr(error, "message", error)).split())  # TF's text: one line
    return StoreUnreachableError(
        f"logdir {path!r}: the object store cannot be reached ({reason}); check the "
        "network and the credentials TensorFlow finds (GOOGLE_APPLICATION_CREDENTIALS, "
        "gcloud's application default credentials, the machine's service account)"
    )


class Store:
    """The files directly inside one logdir."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") if is_object_store(root) else root
        self.local = not is_object_store(root)
        if root.startswith("file://"):
            self.root = root[len("file://") :]

    # -- names --------------------------------------------------------------------

    def path(self, name: str) -> str:
        """The full path of ``name``; a name that is not a plain file name is refused."""
        if not name or name in (".", "..") or "/" in name or (self.local and os.sep in name):
            raise ValueError(f"{name!r} is not a file name inside logdir {self.root!r}")
        return os.path.join(self.root, name) if self.local else f"{self.root}/{name}"

    def name_of(self, path: str) -> str | None:
        """The name of ``path`` if it is directly inside the logdir (a relative path is
        taken as relative to it), else ``None``."""
        if self.local:
            full = path if os.path.isabs(path) else os.path.join(self.root, path)
            parent = os.path.realpath(os.path.dirname(full))
            name = os.path.basename(full)
            inside = parent == os.path.realpath(self.root)
        else:
            full = path if "://" in path else f"{self.root}/{path}"
            scheme, _, rest = full.partition("://")
            parent, name = posixpath.split(posixpath.normpath(rest))
            inside = f"{scheme}://{parent}" == self.root
        return name if inside and name not in ("", ".", "..") else None

    # -- looking ------------------------------------------------------------------

    def names(self) -> list[str]:
        """The names in the logdir (empty if it does not exist)."""
        if self.local:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                return os.listdir(self.root)
            return []
        import tensorflow as tf

        if not tf.io.gfile.isdir(self.root):
            return []
        return [n.rstrip("/") for n in tf.io.gfile.listdir(self.root)]

    def kind(self, name: str) -> Kind | None:
        """``file`` (regular, or a symlink to one inside the logdir), ``dir``, ``other``
        (FIFO, device, socket, a symlink out of the logdir, dangling or looping), or
        ``None`` if there is nothing by that name."""
        path = self.path(name)
        if not self.local:
            import tensorflow as tf

            if tf.io.gfile.isdir(path):
                return "dir"
            return "file" if tf.io.gfile.exists(path) else None
        try:
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                target = os.path.realpath(path)
                root = os.path.realpath(self.root)
                if os.path.commonpath([root, target]) != root:
                    return "other"  # never followed out of the logdir
                info = os.stat(target)
        except FileNotFoundError:
            return None if not os.path.islink(path) else "other"
        except OSError:  # a symlink loop, a name too long...
            return "other"
        if stat.S_ISREG(info.st_mode):
            return "file"
        return "dir" if stat.S_ISDIR(info.st_mode) else "other"

    def exists(self, name: str) -> bool:
        return self.kind(name) is not None

    def size(self, name: str) -> int:
        if self.local:
            return os.stat(self.path(name)).st_size
        import tensorflow as tf

        return int(tf.io.gfile.stat(self.path(name)).length)

    def mtime(self, name: str) -> float:
        if self.local:
            return os.stat(self.path(name)).st_mtime
        import tensorflow as tf

        return float(tf.io.gfile.stat(self.path(name)).mtime_nsec) / 1e9

    def files_of(self, prefix_name: str, names: Iterable[str] | None = None) -> list[str]:
        """The names of a checkpoint's files: TensorFlow's own, ``<prefix>.index`` and
        ``<prefix>.data-?????-of-?????`` (by exact prefix: the basename is never a glob
        pattern). A user's file beside it (``<prefix>.metrics.json``) is not one of them:
        never synced, sized or deleted as the checkpoint's. ``names``: a listing of the
        logdir already made (one listing for many checkpoints, not one each)."""
        listing = self.names() if names is None else names
        return sorted(
            n
            for n in listing
            if n.startswith(prefix_name + ".") and _CHECKPOINT_FILE.fullmatch(n[len(prefix_name) :])
        )

    # -- reading and writing ---------------------------------------------------------

    def read(self, name: str, limit: int = MAX_READ) -> bytes:
        """A regular file's contents, at most ``limit`` bytes (more is an error); never
        blocks on a FIFO and never follows a symlink out of the logdir. On an object
        store it is one request (no FIFOs nor symlinks there to look for first), and a
        missing object is ``FileNotFoundError``."""
        if not self.local:
            return self._read_object(name, limit)
        if self.kind(name) != "file":
            raise OSError(errno.EINVAL, f"{self.path(name)} is not a regular file")
        fd = _open_regular(self.path(name))  # it may have been swapped since kind()
        try:
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{self.path(name)} is larger than {limit} bytes")
        return bytes(data)

    def read_if_there(self, name: str, limit: int = MAX_READ) -> bytes | None:
        """``read``, or ``None`` if there is nothing by that name: on an object store one
        request, where a look first and then the read cost four."""
        if self.local:
            return None if self.kind(name) is None else self.read(name, limit)
        try:
            return self._read_object(name, limit)
        except FileNotFoundError:
            return None

    def _read_object(self, name: str, limit: int) -> bytes:
        import tensorflow as tf

        path = self.path(name)
        try:
            with tf.io.gfile.GFile(path, "rb") as f:
                data = f.read(limit + 1)
        except tf.errors.NotFoundError as exc:
            raise FileNotFoundError(errno.ENOENT, f"{path} is not there") from exc
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes")
        return bytes(data)

    def write(self, name: str, data: bytes, *, durable: bool = True) -> None:
        """Write ``name`` whole (through a temporary name, then a rename; on gs:// in
        place: an object is whole once its upload ends); ``durable``: its bytes fsynced
        before the rename (a copy that another one backs need not be)."""
        temp = f"{name}.tmp{os.getpid()}"
        if self.local:
            with open(self.path(temp), "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(self.path(temp), self.path(name))
            return
        import tensorflow as tf

        if self.root.startswith("gs://"):
            # GCS makes an object visible only once its upload is whole (TF uploads a
            # file it writes at its close, in one resumable upload): written in place, in
            # two requests, where a temporary object renamed (a copy and a delete, and
            # TF's looks before) costs six.
            with tf.io.gfile.GFile(self.path(name), "wb") as f:
                f.write(data)
            return
        with tf.io.gfile.GFile(self.path(temp), "wb") as f:
            f.write(data)
        tf.io.gfile.rename(self.path(temp), self.path(name), overwrite=True)

    def replace(self, name: str, new_name: str) -> None:
        if self.local:
            os.replace(self.path(name), self.path(new_name))
            return
        import tensorflow as tf

        tf.io.gfile.rename(self.path(name), self.path(new_name), overwrite=True)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.local:
                os.remove(self.path(name))
                return
            import tensorflow as tf

            with contextlib.suppress(tf.errors.NotFoundError):
                tf.io.gfile.remove(self.path(name))

    def remove_tree(self, name: str) -> None:
        if self.local:
            shutil.rmtree(self.path(name), ignore_errors=True)
            return
        import tensorflow as tf

        with contextlib.suppress(tf.errors.NotFoundError):
            tf.io.gfile.rmtree(self.path(name))

    def make(self) -> None:
        """Create the logdir (and its parents) if missing."""
        if self.local:
            os.makedirs(self.root, exist_ok=True)
            return
        import tensorflow as tf

        tf.io.gfile.makedirs(self.root)

    def sync(self, names: list[str], *, directory: bool = True) -> None:
        """Make ``names`` durable: fsync each, then (``directory``) the directory, whose
        fsync makes the renames in it durable. A no-op on an object store."""
        if not self.local:
            return
        paths = [self.path(n) for n in names] + ([self.root] if directory else [])
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def writing_back(self, prefix_name: str, last_secs: float | None = None) -> Iterator[None]:
        """While TF writes the checkpoint ``prefix_name``: flush the files of its
        temporary directory (``<prefix>_temp``, where TF's saver writes before it renames)
        every ``WRITE_BACK_SECS`` on a thread of its own, so that the disk writes while TF
        is still serializing and the fsync after the write has little left to do
        (``benchmarks/checkpoint_stall.py`` measures the save against plain Python's
        write + fsync). A no-op on an object store, and for a write whose last one took
        less than ``WRITE_BACK_SECS`` (``last_secs``): it ends before a first flush, and a
        thread started and joined at each save of a small model costs more than it does."""
        if not self.local or (last_secs is not None and last_secs < WRITE_BACK_SECS):
            yield
            return
        directory = self.path(prefix_name + "_temp")
        stop = threading.Event()
        thread = threading.Thread(
            target=_write_back, args=(directory, stop), name="asupervisor-write-back", daemon=True
        )
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _write_back(directory: str, stop: threading.Event) -> None:
    """Flush every regular file in ``directory`` until ``stop``; files that vanish (TF
    renames them into place) are let go. Nothing here may fail the save."""
    opened: dict[str, int] = {}
    try:
        while not stop.wait(WRITE_BACK_SECS):
            with contextlib.suppress(OSError):
                for entry in os.scandir(directory):
                    with contextlib.suppress(OSError):
                        if entry.path not in opened and entry.is_file(follow_symlinks=False):
                            opened[entry.path] = _open_regular(entry.path, os.O_NOFOLLOW)
                        if entry.path in opened:
                            os.fdatasync(opened[entry.path])
    finally:
        for fd in opened.values():
            os.close(fd)


def _open_regular(path: str, flags: int = 0) -> int:
    """A read-only descriptor of ``path`` if it is a regular file, else ``OSError``: the
    open never blocks (a FIFO swapped in since a listing), and the type is checked on
    what was opened, not on a name that can change."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: a full disk makes ``os.write`` write part of it
    and say so only in its count; the rest then raises ``ENOSPC``."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:
            raise OSError(errno.ENOSPC, "no byte could be written")
        view = view[written:]
