"""`asupervisor run --local-dir`: the local tier of checkpoints turned on for every child.

The runner only checks the directory and passes it on in the children's environment
(their sessions read it); so the children here are a few lines of plain Python that
print what they were given. tests/test_local_tier.py tests what a session does with it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asupervisor._cli.run import _local_tier_options
from asupervisor._run.local_tier import ENV_LOCAL_DIR, ENV_LOCAL_SAVE_SECS, local_tier_env
from asupervisor.cli import main

ROOT = Path(__file__).parents[1]

# Prints what the local tier's variables are. The first attempt fails (no commit: a
# restart without progress) once both workers have printed; the second ends done.
PRINTS_ITS_TIER = """
    import json, os, sys, time
    attempt = os.environ["ASUPERVISOR_ATTEMPT"]
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tier = os.environ.get("ASUPERVISOR_LOCAL_DIR"), os.environ.get("ASUPERVISOR_LOCAL_SAVE_SECS")
    os.write(1, f"{attempt} {rank} {tier[0]} {tier[1]}\\n".encode())  # one write: 2 workers
    open(f"printed-{attempt}-{rank}", "w").close()
    if attempt == "1":
        while not all(os.path.exists(f"printed-1-{r}") for r in (0, 1)):
            time.sleep(0.01)
        sys.exit(1) if rank == 0 else time.sleep(600)
"""


@pytest.mark.parametrize("start", ["cold", "standby"])
def test_the_local_dir_and_its_interval_reach_every_worker_of_every_attempt(
    tmp_path: Path, start: str
) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(PRINTS_ITS_TIER))
    warm = ["--standby", "--preload", "json"] if start == "standby" else []
    done = subprocess.run(
        [sys.executable, "-m", "asupervisor", "run", *warm, "--workers", "2", "--backoff", "0",
         "--local-dir", "tier", "--local-save-secs", "2.5", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        # An interval the runner's own environment had is replaced by the one asked for.
        env={**os.environ, "PYTHONPATH": str(ROOT), ENV_LOCAL_SAVE_SECS: "99"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Relative on the command line, absolute for the children (a child may start elsewhere).
    expected = [f"{a} {r} {tmp_path / 'tier'} 2.5" for a in (1, 2) for r in (0, 1)]
    assert sorted(done.stdout.splitlines()) == expected, done.stdout + done.stderr
    assert not (tmp_path / "tier").exists()  # the sessions make it, not the runner


def test_without_local_dir_the_childrens_environment_is_passed_on_as_it_is() -> None:
    assert local_tier_env(None, None) == {}
    assert local_tier_env(None, 3.0) == {}
    assert local_tier_env("/ssd/x", None) == {ENV_LOCAL_DIR: "/ssd/x"}


def test_each_task_of_a_slurm_step_is_given_the_local_dir_to_check_on_its_own_host() -> None:
    assert _local_tier_options(None, None) == []
    assert _local_tier_options("/ssd/x", None) == ["--local-dir", "/ssd/x"]
    assert _local_tier_options("/ssd/x", 0.5) == [
        "--local-dir", "/ssd/x", "--local-save-secs", "0.5",
    ]  # fmt: skip


def bad_local_dirs(tmp_path: Path) -> list[tuple[list[str], str, str]]:
    """``(options, flag the error names, words it says)`` of every local tier the
    command line refuses."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    logdir = tmp_path / "logdir"
    logdir.mkdir()
    cases = [
        (["--local-dir", "gs://bucket/tier"], "--local-dir", "is an object store"),
        (["--local-dir", ""], "--local-dir", "is empty"),
        (["--local-dir", str(a_file)], "--local-dir", "not a directory"),
        (["--local-dir", str(a_file / "tier")], "--local-dir", "not a directory"),
        (["--logdir", str(logdir), "--local-dir", str(logdir)], "--local-dir", "overlaps"),
        (["--logdir", str(logdir), "--local-dir", str(logdir / "tier")], "--local-dir",
         "overlaps"),
        (["--logdir", str(logdir / "run"), "--local-dir", str(logdir)], "--local-dir",
         "overlaps"),
        (["--local-save-secs", "5"], "--local-save-secs", "needs --local-dir"),
        (["--local-dir", str(tmp_path / "t"), "--local-save-secs", "0"], "--local-save-secs",
         "> 0"),
        (["--local-dir", str(tmp_path / "t"), "--local-save-secs", "nan"], "--local-save-secs",
         "> 0"),
        (["--local-dir", str(tmp_path / "t"), "--local-save-secs", "soon"],
         "--local-save-secs", "> 0"),
    ]  # fmt: skip
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((["--local-dir", str(locked / "tier")], "--local-dir", "not writable"))
    return cases


def test_a_local_tier_that_cannot_be_one_is_a_one_line_error_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    witness = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(witness)!r}, 'w')"]
    for options, flag, words in bad_local_dirs(tmp_path):
        assert main(["run", *options, "--", *command]) == 2, options
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"asupervisor run: error: {flag} "), err
        assert words in err, (options, err)
    assert not witness.exists()  # checked before anything started


def test_the_local_dir_is_checked_before_the_slurm_step_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "--slurm", "--logdir", str(tmp_path), "--local-dir", "gs://b/t",
                   "--", "true"])  # fmt: skip
    assert status == 2
    assert "--local-dir" in capsys.readouterr().err


def test_run_help_explains_the_local_tier(capsys: pytest.CaptureFixture[str]) -> None:
    with contextlib.suppress(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for text in ("--local-dir DIR", "--local-save-secs SECS", "ASUPERVISOR_LOCAL_DIR",
                 "/dev/shm", "steps at risk", "new host"):  # fmt: skip
        assert text in out, text


# A session that commits into the local tier only (the mirror has not copied it to the
# logdir yet) and is SIGKILLed before its next beat could tell the runner.
COMMITS_LOCALLY_THEN_KILLED = """
    import os, signal, sys
    from asupervisor._checkpointing.tiers import tier_name
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.history import Provenance
    from asupervisor._logdir.records import Record
    from asupervisor._logdir.store import Store
    logdir, attempt = sys.argv[1], int(os.environ["ASUPERVISOR_ATTEMPT"])
    if attempt == 4:
        sys.exit(0)
    tier = Store(os.path.join(os.environ["ASUPERVISOR_LOCAL_DIR"], tier_name(logdir)))
    tier.make()
    catalog = Catalog(tier, "model.ckpt", writer=True,
                      provenance=Provenance.of_session(f"s{attempt}"))
    catalog.load()
    catalog.commit(f"model.ckpt-{100 * attempt}", Record(100 * attempt, 0.0))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_soon_after_a_local_commit_the_logdir_lacks_is_progress_at_once(
    tmp_path: Path,
) -> None:
    logdir, tier = tmp_path / "run", tmp_path / "tier"
    logdir.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(COMMITS_LOCALLY_THEN_KILLED))
    # One failure without progress ends the run: each restart must be judged progress.
    done = subprocess.run(
        [sys.executable, "-m", "asupervisor", "run", "--logdir", str(logdir), "--local-dir",
         str(tier), "--max-failures", "1", "--", sys.executable, str(script), str(logdir)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    restarts = [line for line in done.stderr.splitlines() if "run.restarting" in line]
    assert len(restarts) == 3, done.stderr
    for number, line in enumerate(restarts, start=1):
        assert f"committed={100 * number} " in line, line
        assert "progress='yes (costs nothing)'" in line, line
    assert not list(logdir.iterdir())  # nothing was in the logdir: the local tier decided
    assert "history_unread" not in done.stderr, done.stderr
