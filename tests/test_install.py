"""A plain install works: the wheel, in a clean venv, with only what it declares.

The clean venv gets the built wheel (no extras) and, of the packages installed
here, exactly the closure of the wheel's declared requirements, linked in rather
than downloaded again (TensorFlow is 600 MB). A module the library imports but
does not declare (sniffio, once) is then missing, as it would be after
``pip install asupervisor`` on a fresh machine.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.slow

TEN_STEPS = textwrap.dedent(
    """
    import sys
    import anyio, tensorflow as tf
    import asupervisor as asv

    v = tf.Variable(0.0)

    async def main() -> None:
        sv = asv.Supervisor(sys.argv[1], checkpoint={"v": v}, save_model_secs=60,
                            save_summaries_secs=0.05, summary_fn=lambda: {"v": v})
        async with sv.session() as sess:
            for _ in range(10):
                await sess.run(v.assign_add, 1.0)
        print("trained", sess.global_step, asv.hooks.StopAtStepHook.__name__)

    anyio.run(main)
    """
)


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


def test_the_wheel_installs_with_what_it_declares_and_runs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("asupervisor-*.whl")
    clean = tmp_path / "clean"
    venv.EnvBuilder(with_pip=False).create(clean)
    python = clean / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    declared = (
        metadata.Distribution.at(
            next((clean / "lib").glob("python*/site-packages/asupervisor-*.dist-info"))
        ).requires
        or []
    )
    site = next((clean / "lib").glob("python*/site-packages"))
    link_distributions(closure(declared), site)

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
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
    assert done.stdout.split() == ["trained", "10", "StopAtStepHook"]
    assert "service.failed" not in done.stderr, done.stderr[-3000:]  # summaries were written

    inspect = subprocess.run(
        [str(clean / "bin" / "asupervisor"), "inspect", str(logdir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    assert "latest checkpoint:" in inspect.stdout and "(step 10)" in inspect.stdout
    assert re.search(r"^\s+v\s+scalar", inspect.stdout, re.MULTILINE), inspect.stdout
