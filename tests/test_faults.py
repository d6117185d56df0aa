"""Faults in one process: each gets a clear error or a logged recovery, and the last
good checkpoint survives."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.verify import verify_checkpoint
from tests.conftest import Pair, named

pytestmark = pytest.mark.asyncio


@contextlib.contextmanager
def unwritable(path: str) -> Iterator[None]:
    """Make a directory unwritable for real: root ignores permission bits, not chattr +i."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("running as root without chattr: cannot make a directory unwritable")
        done = subprocess.run(["chattr", "+i", path], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"this filesystem has no immutable flag: {done.stderr!r}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", path], check=True)
    else:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)


def make(logdir: str, pair: Pair, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 3600)
    kwargs.setdefault("save_model_steps", 2)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, checkpoint={"pair": pair}, **kwargs)


async def test_an_unwritable_logdir_is_a_clear_error_at_entry(logdir: str) -> None:
    os.makedirs(logdir)
    with unwritable(logdir), pytest.raises(OSError, match="cannot write into logdir"):
        async with make(logdir, Pair()).session():
            pass
    assert os.listdir(logdir) == []


async def test_a_logdir_that_becomes_unwritable_keeps_the_last_good_checkpoint(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    pair = Pair()
    with pytest.raises(asv.CheckpointSaveError):
        async with make(logdir, pair).session() as sess:
            for _ in range(4):
                await sess.run(pair.step)
            with unwritable(logdir):
                for _ in range(20):
                    if sess.should_stop():
                        break
                    await sess.run(pair.step)
    assert [e["step"] for e in named(events, "checkpoint.failed")] == [6, 8, 10]
    latest = tf.train.latest_checkpoint(logdir)
    assert latest.endswith("model.ckpt-4") and verify_checkpoint(latest) is None


async def test_an_exception_inside_a_hook_reaches_the_caller(logdir: str) -> None:
    boom = RuntimeError("hook failed")

    class Failing(asv.Hook):
        def before_run(self, ctx: asv.RunContext) -> None:
            if ctx.step == 5:
                raise boom

    pair = Pair()
    with pytest.raises(RuntimeError) as raised:
        async with make(logdir, pair, hooks=[Failing()]).session() as sess:
            while True:
                await sess.run(pair.step)
    assert raised.value is boom and sess.stop_reason == "exception"
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-4")  # no final save


async def test_a_deleted_events_file_is_replaced_and_logged(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    pair = Pair()
    sv = make(logdir, pair, save_summaries_secs=0.05, summary_fn=lambda: {"a": pair.a})
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(pair.step)
            await anyio.sleep(0.03)
        (first,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
        os.remove(first)
        for _ in range(10):
            await sess.run(pair.step)
            await anyio.sleep(0.03)
    lost = named(events, "summary.file_lost")
    assert len(lost) == 1 and lost[0]["path"] == first
    (second,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    assert second == lost[0]["new_path"] != first
    steps = [
        e.step
        for e in tf.compat.v1.train.summary_iterator(second)
        for v in e.summary.value
        if v.tag == "a"
    ]
    assert steps and steps[-1] == 15  # the summaries after the deletion were kept


async def test_a_corrupt_newest_checkpoint_is_skipped_on_restart(logdir: str) -> None:
    pair = Pair()
    async with make(logdir, pair).session() as sess:
        for _ in range(6):
            await sess.run(pair.step)
    Path(logdir, "model.ckpt-6.data-00000-of-00001").write_bytes(b"\x00" * 3)
    again = Pair()
    async with make(logdir, again).session() as sess:
        assert sess.restore_report.step == 4 and float(again.a.numpy()) == 4.0
