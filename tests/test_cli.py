"""`asupervisor inspect`: the table, the JSON, damage reported, clear errors, fast start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asupervisor as asv
from asupervisor.cli import main
from tests import forked
from tests.conftest import Pair


async def make_run(logdir: str) -> None:
    pair = Pair()
    sv = asv.Supervisor(
        logdir,
        checkpoint={"p": pair},
        save_model_secs=0,
        save_model_steps=2,
        save_summaries_secs=0,
        max_to_keep=None,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(4):
            await sess.run(pair.step)
            sess.summary_computed({"loss": 10.0 - sess.global_step})


@pytest.mark.asyncio
async def test_inspect_prints_checkpoints_tags_and_events(
    logdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await make_run(logdir)
    capsys.readouterr()  # the run's own log lines
    assert main(["inspect", logdir]) == 0
    out = capsys.readouterr().out
    assert "latest checkpoint: model.ckpt-4  (step 4)" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s.*\syes\b", line)]
    assert [int(row[0]) for row in rows] == [0, 2, 4]
    assert any(cell.startswith("loss=") for cell in rows[-1])  # what the commit recorded
    loss = next(line for line in out.splitlines() if line.strip().startswith("loss "))
    assert loss.split()[:4] == ["loss", "scalar", "6", "1..4"]
    assert "events files (1):" in out


@pytest.mark.asyncio
async def test_inspect_lists_fits_runs_with_their_tags(
    logdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 2), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)
    sv = asv.Supervisor(
        logdir, checkpoint={"model": model}, save_model_secs=0, save_summaries_secs=0,
        handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.fit(model, data, epochs=2, validation_data=data, verbose=0)
    capsys.readouterr()  # the run's own log lines
    assert main(["inspect", logdir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for tag in ("train/epoch_loss", "validation/epoch_loss", "train/epoch_learning_rate"):
        assert report["tags"][tag]["kind"] == "scalar", sorted(report["tags"])
        assert (report["tags"][tag]["first_step"], report["tags"][tag]["last_step"]) == (0, 1)
    names = [f["name"] for f in report["events_files"]]
    assert [n.split("events.out.")[0] for n in names] == ["", "train/", "validation/"]


@pytest.mark.asyncio
async def test_inspect_json_reports_damage(logdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    await make_run(logdir)
    data_file = Path(logdir) / "model.ckpt-2.data-00000-of-00001"
    data_file.write_bytes(data_file.read_bytes()[:10])  # a torn write
    events = next(Path(logdir).glob("events.out.tfevents.*"))
    events.write_bytes(events.read_bytes()[:-7])  # a cut-off last record
    capsys.readouterr()  # the run's own log lines
    assert main(["inspect", logdir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    readable = {c["step"]: c["readable"] for c in report["checkpoints"]}
    assert readable == {0: True, 2: False, 4: True}
    assert next(c for c in report["checkpoints"] if c["step"] == 2)["problem"]
    assert report["latest_step"] == 4
    assert report["events_files"][0]["damaged"]
    assert report["tags"]["loss"]["kind"] == "scalar"
    assert report["tags"]["loss"]["first_step"] == 1


def test_missing_and_empty_logdirs_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    assert "no checkpoints, no events files and no ledger" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main([])
    assert usage.value.code == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("store", ["ram", "gs"])  # local: the tests above
async def test_inspect_reads_every_store_and_a_missing_logdir_exits_2(
    store: str, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    run = request.getfixturevalue("gcs").new_path() if store == "gs" else f"ram://{tmp_path.name}/r"
    await make_run(run)
    capsys.readouterr()
    assert main(["inspect", run]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if re.match(r"\s+\d+\s.*\syes\b", line)]
    assert [int(row[0]) for row in rows] == [0, 2, 4]
    missing = run.rsplit("/", 1)[0] + "/nope"
    assert main(["inspect", missing]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_help_is_fast_because_it_does_not_import_tensorflow() -> None:
    code = (
        "import sys\n"
        "from asupervisor.cli import main\n"
        "try:\n    main(['inspect', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TF' if 'tensorflow' in sys.modules else 'no TF')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "LOGDIR" in done.stdout and "--json" in done.stdout and "exit status" in done.stdout
    assert done.stdout.strip().endswith("no TF")


@pytest.mark.asyncio
async def test_inspect_is_safe_on_a_hostile_directory(logdir: str, tmp_path: Path) -> None:
    await make_run(logdir)
    run = Path(logdir)
    os.mkfifo(run / "model.ckpt-3.index")  # reading it would wait for a writer forever
    (run / "checkpoint").unlink()
    (run / "checkpoint").symlink_to("/dev/zero")  # endless bytes, outside the logdir
    (run / "model.ckpt-7.index").symlink_to("model.ckpt-7.index")  # a loop
    (run / "model.ckpt-9.index").symlink_to(tmp_path / "nothing")  # dangling
    (run / "events.out.tfevents.x\nlatest checkpoint: EVIL \x1b[31m").write_bytes(b"")
    (run / "events.out.tfevents.\x1b]0;owned\x07").write_bytes(b"")
    # A child process, bounded: a hang fails the test instead of stalling the suite.
    done = forked.run(
        [sys.executable, "-m", "asupervisor", "inspect", logdir],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert not any(line.startswith("latest checkpoint: EVIL") for line in done.stdout.splitlines())
    assert "\\nlatest checkpoint: EVIL \\x1b[31m" in done.stdout  # shown, escaped
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if "NO " in line}
    assert "not a regular file" in rows["3"] and "not a regular file" in rows["7"]
    assert "not a regular file" in rows["9"] or "gone" in rows["9"]
    # The state file (endless bytes) was not read: the latest is the history's head.
    assert re.search(r"latest checkpoint: \S*model\.ckpt-4  \(step 4\)", done.stdout)
