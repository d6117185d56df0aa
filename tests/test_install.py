"""A plain install works: the wheel, in a clean venv, with only what it declares; and
what a user's tools see of an install, wheel or editable: the version, and the types.

The clean venv gets the built wheel (no extras) and, of the packages installed
here, exactly the closure of the wheel's declared requirements, linked in rather
than downloaded again (TensorFlow is 600 MB). A module the library imports but
does not declare is then missing, as it would be after ``pip install asupervisor``
on a fresh machine.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

import asupervisor as asv
from asupervisor.cli import main as cli

ROOT = Path(__file__).parents[1]

TEN_STEPS = textwrap.dedent(
    """
    import sys
    import anyio, tensorflow as tf
    import asupervisor as asv
    from asupervisor.cli import main as cli

    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(sys.argv[1], checkpoint={"v": v}, save_model_secs=60,
                            save_summaries_secs=0.05, summary_fn=lambda: {"v": v})
        async with sv.session() as sess:
            for _ in range(10):
                await sess.run(v.assign_add, 1.0)
        print("trained", sess.global_step, asv.hooks.StopAtStepHook.__name__, flush=True)

    anyio.run(main)
    # `asupervisor inspect` on what it wrote, in this process: TensorFlow is imported once
    # (a second interpreter would import it again to read the checkpoint); the installed
    # command itself runs below (--version).
    sys.exit(cli(["inspect", sys.argv[1]]))
    """
)


# A user's script: mypy --strict must see the package's types through either install.
TYPED = textwrap.dedent(
    """
    from __future__ import annotations

    import sys
    from typing import Any

    import asupervisor as asv
    from asupervisor.hooks import StopAtStepHook
    from asupervisor.services import ProgressService


    class PrintLoss(asv.Hook):
        def after_run(self, ctx: asv.RunContext, result: Any) -> None:
            if ctx.step % 100 == 0:
                print("step", ctx.step, result["loss"])


    sv = asv.Supervisor(
        "runs/typed", save_model_secs=60, hooks=[StopAtStepHook(last_step=10), PrintLoss()]
    )


    @sv.service
    async def ticker(sess: asv.ManagedSession) -> None:
        while not await sess.sleep_until_stop(5):
            asv.logger.info("ticker.tick", step=sess.global_step)


    def step() -> dict[str, float]:
        return {"loss": 1.0}


    async def main() -> None:
        async with sv.session() as sess:
            sess.start_service(ProgressService(1.0))
            while not sess.should_stop():
                await sess.run(step)
        outcome: asv.Outcome | None = sess.outcome
        print("exit status", asv.exit_status(outcome), asv.__version__)


    if __name__ == "__main__":
        sys.exit(asv.run(main))
    """
)
# ... and a mistake in one, which it must report: the types are read, not taken as Any.
MISTAKE = 'import asupervisor as asv\n\nsv = asv.Supervisor("runs/x", save_model_secs="often")\n'


def pyproject_version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml names no version"
    return found[1]


def test_the_version_is_the_one_in_pyproject() -> None:
    assert asv.__version__ == metadata.version("asupervisor") == pyproject_version()


def test_asupervisor_version_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"asupervisor {pyproject_version()}\n"


def mypy_strict(tmp_path: Path, python: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` on a user's script and on a mistake, as seen by ``python``'s
    installed packages (run from a directory that holds nothing else)."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "train.py").write_text(TYPED)
    (user / "mistake.py").write_text(MISTAKE)
    env = {**os.environ, "MYPYPATH": ""}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable",
         str(python), "--config-file", os.devnull, "train.py", "mistake.py"],
        capture_output=True, text=True, timeout=600, env=env, cwd=user,
    )  # fmt: skip


def assert_types_seen(done: subprocess.CompletedProcess[str]) -> None:
    lines = done.stdout.strip().splitlines()
    assert lines[:-1] == [
        'mistake.py:3: error: Argument "save_model_secs" to "Supervisor" has incompatible '
        'type "str"; expected "float"  [arg-type]'
    ], done.stdout + done.stderr
    assert "train.py" not in done.stdout


@pytest.mark.slow
def test_mypy_strict_sees_the_types_of_an_editable_install(tmp_path: Path) -> None:
    """What `make` installs: ``pip install -e .`` (a path in a .pth file, which mypy reads)."""
    installs = [d.read_text("direct_url.json") for d in metadata.distributions(name="asupervisor")]
    if not any(json.loads(i).get("dir_info", {}).get("editable") for i in installs if i):
        pytest.skip("asupervisor is not installed editable here")
    assert_types_seen(mypy_strict(tmp_path, Path(sys.executable)))


def _name(requirement: str) -> str:
    return re.split(r"[\s;\[<>=!~(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def closure(requirements: list[str]) -> set[str]:
    """The installed distributions that ``requirements`` need, transitively (no extras)."""
    found: set[str] = set()
    todo = [r for r in requirements if "extra ==" not in r]
    while todo:
        name = _name(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        found.add(name)
        todo.extend(r for r in dist.requires or [] if "extra ==" not in r)
    return found


def link_distributions(names: set[str], site: Path) -> None:
    """Make exactly these installed distributions importable in ``site``."""
    for name in names:
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if ".." not in Path(str(f)).parts}
        for top in tops:
            target = site / top
            if not target.exists() and (base / top).exists():
                target.symlink_to(base / top)


@pytest.mark.slow
def test_the_wheel_installs_with_what_it_declares_and_runs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("asupervisor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "asupervisor/py.typed" in names  # PEP 561: its types are for users' type checkers
    # services/ (the project's top level) is installed as asupervisor.services, its files
    # in the wheel (not a link): the TYPED script below imports it under mypy --strict.
    assert "asupervisor/services/__init__.py" in names and "asupervisor/services" not in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    clean = tmp_path / "clean"
    venv.EnvBuilder(with_pip=False).create(clean)
    python = clean / "bin" / "python"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONNOUSERSITE": "1"}
    # A PYTHONPATH naming a source tree (as in a worktree) would show pip asupervisor
    # installed already, and it would install nothing.
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         str(wheel)],
        check=True, timeout=300, env=env,
    )  # fmt: skip
    declared = (
        metadata.Distribution.at(
            next((clean / "lib").glob("python*/site-packages/asupervisor-*.dist-info"))
        ).requires
        or []
    )
    site = next((clean / "lib").glob("python*/site-packages"))
    link_distributions(closure(declared), site)

    script = tmp_path / "ten_steps.py"
    script.write_text(TEN_STEPS)
    logdir = tmp_path / "run"
    done = subprocess.run(
        [str(python), "-I", str(script), str(logdir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trained, _, inspected = done.stdout.partition("\n")
    assert trained.split() == ["trained", "10", "StopAtStepHook"]
    assert "service.failed" not in done.stderr, done.stderr[-3000:]  # summaries were written
    assert "latest checkpoint:" in inspected and "(step 10)" in inspected, inspected
    assert re.search(r"^\s+v\s+scalar", inspected, re.MULTILINE), inspected

    version = subprocess.run(
        [str(clean / "bin" / "asupervisor"), "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert (version.returncode, version.stdout) == (0, f"asupervisor {pyproject_version()}\n")

    assert_types_seen(mypy_strict(tmp_path, python))
