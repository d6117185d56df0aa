"""Shared fixtures. TensorFlow is quieted before anything imports it, and imported only
where a test needs it (pytest-xdist's controller runs no test: it does not import it)."""

from __future__ import annotations

import gc
import logging
import os
import random
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The model-based searches' seed: one per run, drawn here (before pytest-xdist starts its
# workers, which inherit it) unless given; printed first and last (tests/search.py).
os.environ.setdefault("ASV_SEED", str(random.SystemRandom().randrange(2**32)))

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import structlog

import asupervisor as asv
from tests.gcs_fixture import FakeGcs, binary
from tests.search import replay_line

if TYPE_CHECKING:
    from tests.pair import Pair
    from tests.slurm_cluster import Cluster as SlurmCluster

RUN_DIR_ENV = "ASV_RUN_DIR"  # a directory pytest-xdist's workers share (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist run, one fork server for every worker (each would import
    TensorFlow again for a server of its own); started before the workers, which inherit
    where it is."""
    if not hasattr(config, "workerinput"):
        _share_one_slurm_cluster(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import tempfile

        from tests import forked

        place = tempfile.mkdtemp(prefix="asv-forkserver-")
        config.add_cleanup(lambda: shutil.rmtree(place, ignore_errors=True))
        # A directory the workers share for this run (what one computes, the others
        # read: tests/test_resume_equivalence.py's runs left alone); gone when it ends.
        shared = tempfile.mkdtemp(prefix="asv-run-")
        os.environ[RUN_DIR_ENV] = shared  # the workers inherit it

        def end_shared() -> None:
            os.environ.pop(RUN_DIR_ENV, None)
            shutil.rmtree(shared, ignore_errors=True)

        config.add_cleanup(end_shared)
        config.add_cleanup(forked.share(os.path.join(place, "socket")))  # ended first
        # The workers themselves fork from it: TensorFlow is imported once for the run.
        warm = f"popen//python={sys.executable} {Path(__file__).parent / 'warm_worker.py'}"
        config.option.tx = [warm if spec == "popen" else spec for spec in config.option.tx]


def _share_one_slurm_cluster(config: pytest.Config) -> None:
    """One SLURM cluster for the whole run (tests/slurm_cluster.py: the first test that
    needs it brings it up; every worker shares it), ended when the run ends; unless
    ASV_SLURM_DIR already names one."""
    import tempfile

    from tests import slurm_cluster

    if os.environ.get(slurm_cluster.SHARED_ENV):
        # A cluster brought up by hand (python -m tests.slurm_cluster up DIR) is shared by
        # every run that names it, and outlives them: its owner ends it.
        return
    place = tempfile.mkdtemp(prefix="asv-slurm-")
    os.environ[slurm_cluster.SHARED_ENV] = place  # the workers inherit it

    def down() -> None:
        slurm_cluster.Cluster(Path(place)).down()
        shutil.rmtree(place, ignore_errors=True)

    config.add_cleanup(down)


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The suite's SLURM cluster; the test is skipped, saying why, where none can run."""
    from tests import slurm_cluster

    why = slurm_cluster.unavailable()
    if why:
        pytest.skip(why)
    return slurm_cluster.shared()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The suite's SLURM cluster, shared with the other tests while this one runs (the one
    that loses a node loses one of its own: tests/slurm_cluster.py's ``loss`` partition)."""
    return slurm_cluster


def pytest_report_header(config: pytest.Config) -> str:
    return replay_line()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(replay_line())
    from tests.slurm_cluster import unavailable

    why = unavailable()
    if why:  # the tests on a real SLURM cluster were skipped: say why, in one line
        terminalreporter.write_line(f"SLURM cluster tests skipped: {why}")


# The files whose tests take longest (real runs of `asupervisor run`, cold starts, searches
# across processes, the object-store emulator), longest first. They are handed out first,
# shared among the workers, so that no worker starts a minute-long test when the others
# are done.
LONGEST_FIRST = (
    "test_slurm_faults.py",
    "test_run_sessions.py",
    "test_demo.py",
    "test_install.py",
    "test_resume_equivalence.py",
    "test_multiworker.py",
    "test_docs.py",
    "test_kills.py",
    "test_local_tier_kills.py",
    "test_callback_state.py",
    "test_keep_best.py",
    "test_object_store.py",
    "test_readme.py",
    "test_fit_callbacks.py",
    "test_model_based_processes.py",
    "test_model_based.py",
    "test_history.py",
    "test_endings.py",
    "test_end_of_data.py",
    "test_store.py",
    "test_evaluator.py",
    "test_slurm_cluster.py",
    "test_signals.py",
    "test_cli.py",
    "test_run.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found
    # pytest-xdist's worksteal hands each worker one contiguous part of this list, and a
    # worker steals from the end of another's: dealt out like cards, every part begins
    # with its share of the longest tests (else one worker holds all of them, in a row).
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        items[:] = [item for part in range(workers) for item in items[part::workers]]


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives as long as the run: out of the cyclic collector's
    sight from now on, so that the collections during tests scan only what tests make
    (about a third of their time, a few percent of the suite's CPU)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Tests marked ``anyio`` run on both of anyio's backends."""
    return str(request.param)


@pytest.fixture
def logdir(tmp_path: Path) -> str:
    return str(tmp_path / "run")


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcs]:
    """The GCS emulator and its proxy (tests/gcs_fixture.py), one for the whole run;
    skipped only where the emulator's binary cannot run on this machine."""
    try:
        subprocess.run([binary(), "--help"], capture_output=True, timeout=60, check=False)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"the fake-gcs-server binary cannot run here: {exc}")
    with FakeGcs() as server:
        yield server


@pytest.fixture
def gcs(gcs_server: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> FakeGcs:
    """TF's ``gs://`` reaches the emulator during this test (and in the subprocesses it
    starts with ``os.environ``); the variables go when it ends."""
    for name, value in gcs_server.env.items():
        monkeypatch.setenv(name, value)
    return gcs_server


@pytest.fixture(params=["ram", "gs"])
def object_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A logdir that does not exist yet, on an object store: TF's in-memory ``ram://``,
    and ``gs://`` through the emulator."""
    if request.param == "gs":
        gcs: FakeGcs = request.getfixturevalue("gcs")
        return gcs.new_path()
    return f"ram://{tmp_path.name}/run"


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    """The library's structured log events, every level, captured."""
    library = logging.getLogger("asupervisor")
    level = library.level
    library.setLevel(logging.DEBUG)  # the library's logger decides what is emitted
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        library.setLevel(level)


@pytest.fixture
def pair() -> Pair:
    from tests.pair import Pair

    return Pair()


def named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def pair_supervisor(logdir: str, pair: Pair, **kwargs: Any) -> asv.Supervisor:
    """A Supervisor over a Pair that saves every 2 steps and keeps every checkpoint."""
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_model_steps", 2)
    kwargs.setdefault("max_to_keep", None)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, checkpoint={"pair": pair}, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Pair":  # where the tests have always found it
        from tests.pair import Pair

        return Pair
    raise AttributeError(name)
