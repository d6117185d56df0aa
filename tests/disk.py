"""A small real file system that a test can fill (ENOSPC), for the full-disk tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(where: Path, size: str = "16m") -> Iterator[Path | None]:
    """A tmpfs of ``size`` mounted at ``where`` while inside, or ``None`` where none can
    be mounted (not root, no mount namespace); it says why on stdout."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(f"no tmpfs can be mounted here ({done.stderr.strip()})")
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def fill(filler: Path) -> Iterator[None]:
    """The disk holding ``filler`` is full while inside (ENOSPC), and free again after."""
    try:
        with open(filler, "wb", buffering=0) as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * 65536)
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * 512)
        yield
    finally:
        filler.unlink(missing_ok=True)
