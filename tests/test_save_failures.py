"""A full disk: failed saves are logged, retried, and never touch the last good checkpoint."""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.verify import verify_checkpoint
from tests import forked
from tests.disk import fill, small_disk

# RLIMIT_FSIZE makes every write past 64 KiB fail with EFBIG, as a full disk fails
# with ENOSPC; SIGXFSZ is ignored so that the write fails instead of killing us.
FULL_DISK_RUN = textwrap.dedent(
    """
    import resource, signal, sys
    import anyio, tensorflow as tf
    import asupervisor as asv

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    big = tf.Variable(tf.zeros([256, 1024]))  # 1 MiB: a checkpoint no longer fits

    async def main() -> None:
        sv = asv.Supervisor(sys.argv[1], checkpoint={"big": big}, save_model_secs=0,
                            save_model_steps=5, save_summaries_secs=0, handle_signals=False)
        async with sv.session() as sess:
            for _ in range(100):
                await sess.run(big.assign_add, tf.ones([256, 1024]))
                print("step", sess.global_step, flush=True)
                if sess.global_step == 7:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    anyio.run(main)
    """
)


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_good_checkpoint_and_ends_the_run(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_RUN)
    done = forked.run(
        [sys.executable, str(script), str(logdir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert done.returncode != 0, "the run went on although no checkpoint could be written"
    # Unconfigured logging shows warnings and errors on stderr: each failure is there.
    assert done.stderr.count("checkpoint.failed") == 3
    assert "step 19" in done.stdout and "step 20" not in done.stdout  # 10, 15, 20 failed
    assert "consecutive_failures=3" in done.stderr
    assert "asupervisor.CheckpointSaveError: 3 checkpoint saves in a row failed" in done.stderr
    assert "model.ckpt-5" in done.stderr.split("CheckpointSaveError")[-1]  # names the good one
    latest = tf.train.latest_checkpoint(str(logdir))
    assert latest is not None and latest.endswith("model.ckpt-5")
    for step in (0, 5):
        assert verify_checkpoint(str(logdir / f"model.ckpt-{step}")) is None
    reader = tf.train.load_checkpoint(latest)
    key = next(k for k in reader.get_variable_to_shape_map() if k.startswith("big/"))
    assert float(reader.get_tensor(key)[0, 0]) == 5.0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_background_save_that_fails_at_the_last_step_fails_the_final_save_too(
    tmp_path: Path, backend: str
) -> None:
    """A timed background save of the last step is in flight when the body leaves; the
    disk is full, so it fails. The final save is not that write until it is on disk: it
    is written again, fails, and the session ends failed (CheckpointSaveError), never
    done with the steps since the last checkpoint silently lost."""
    with small_disk(tmp_path / "disk") as disk:
        if disk is None:
            pytest.skip("no tmpfs can be mounted here to fill")
        v = tf.Variable(0.0)
        sv = asv.Supervisor(
            str(disk / "run"), checkpoint={"v": v}, save_model_secs=0, save_model_steps=3,
            async_checkpoint=True, save_summaries_secs=0, handle_signals=False,
        )  # fmt: skip

        async def main() -> None:
            with contextlib.ExitStack() as full:
                with pytest.raises(asv.CheckpointSaveError, match="final checkpoint at step 3"):
                    async with sv.session() as sess:
                        while tf.train.latest_checkpoint(str(disk / "run")) is None:
                            await anyio.sleep(0.01)  # step 0's checkpoint is on disk
                        full.enter_context(fill(disk / "filler"))
                        for _ in range(3):  # step 3's save is written in the background
                            await sess.run(v.assign_add, 1.0)
                assert sess.outcome is asv.Outcome.FAILED

        anyio.run(main, backend=backend)
