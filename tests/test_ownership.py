"""The code's own rules, checked on its source: one owner per piece of state, typed protocols.

- No module assigns another object's attributes: only ``self`` (or ``cls``) is assigned
  to, or an object the same function has just made (a message, an exception, a module it
  builds). What a third party's API says to set is listed below, with why.
- No module reaches into another object's private members: an attribute whose name
  starts with ``_`` is read only on ``self`` or ``cls`` (also through ``getattr`` with a
  literal name), and no module imports another module's private names (a private
  *module*, ``from .. import _exit``, is the package's own). What stays is listed below,
  with why.
- Job kinds, stop reasons and outcomes are enums, compared only as enums: no comparison
  in the library holds one of their values as a string literal.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from asupervisor._kinds import JobKind, Phase
from asupervisor._outcome import Outcome, StopReason

ROOT = Path(__file__).parents[1]
# services/ sits at the top level (installed as asupervisor.services, reached in a checkout
# through the asupervisor/services link, which glob does not follow).
SOURCES = sorted([*ROOT.glob("asupervisor/**/*.py"), *ROOT.glob("services/**/*.py")])


def where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# Attributes a third party's API asks its users to set.
ALLOWED = {
    "stop_training",  # Keras: a callback ends fit with `self.model.stop_training = True`
    "__cause__",  # exception chaining, on an exception this function raises
}


def assignments(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, target)`` of every attribute assignment to something that is not the
    function's own (``self``, ``cls``) nor made by it (a name bound to a call)."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        made = {
            target.id
            for node in ast.walk(fn)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for attr in ast.walk(target):
                    if not isinstance(attr, ast.Attribute) or not isinstance(attr.ctx, ast.Store):
                        continue
                    base = attr.value
                    while isinstance(base, ast.Attribute):
                        base = base.value  # event.session_log.status: event's own part
                    owner = base.id if isinstance(base, ast.Name) else None
                    own = owner in ("self", "cls") and isinstance(attr.value, ast.Name)
                    if own or owner in made or attr.attr in ALLOWED:
                        continue
                    yield attr.lineno, ast.unparse(attr)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_module_assigns_another_objects_attributes(path: Path) -> None:
    found = list(assignments(ast.parse(path.read_text())))
    assert found == [], f"{path.name} assigns attributes it does not own: {found}"


def test_the_checker_finds_an_assignment_from_outside() -> None:
    code = "def f(rt, report):\n    rt.restore_report = report\n    self_made = g()\n"
    code += "    self_made.x = 1\n"
    assert list(assignments(ast.parse(code))) == [(2, "rt.restore_report")]
    nested = "class A:\n    def m(self):\n        self.stepper.count = 0\n"
    assert list(assignments(ast.parse(nested))) == [(3, "self.stepper.count")]


# Private members read from outside, by module: the expression, and why it stays.
REACHES = {
    "asupervisor/_checkpointing/async_save.py": {
        # TF has no public way to gather the tensors a save writes; the copy-on-write
        # snapshot uses the call TF's own async checkpointing makes.
        "checkpoint._saver",
        "checkpoint._saver._gather_serialized_tensors",
    },
    "asupervisor/_training/steps.py": {
        # A tf.function says whether it reduces retracing only privately; the step fused
        # with the global step's increment keeps the user's choice.
        'getattr(fn, "_reduce_retracing", ...)',
    },
    "asupervisor/_training/reader.py": {
        # A tf.data iterator's state as tensors: the saveable protocol every Trackable
        # implements and tf.train.Checkpoint calls; the reader stores the state beside
        # the position instead of re-binding a new iterator into the checkpoint per epoch.
        'hasattr(iterator, "_serialize_to_tensors")',
        "iterator._serialize_to_tensors",
        "iterator._restore_from_tensors",
        # Whether a shuffle has no seed at all (one log line at start, data.not_exact): a
        # pipeline's inputs and a shuffle's seeds are not public.
        'getattr(dataset, "_inputs", ...)',
        'getattr(dataset, "_seed", ...)',
        'getattr(dataset, "_seed2", ...)',
    },
    "asupervisor/_training/fingerprint.py": {
        # A pipeline's graph, as TF's own checkpoints and tf.data service serialize it
        # (the public ``DatasetToGraphV2`` op needs the dataset's variant, private too).
        'getattr(dataset, "_as_serialized_graph", ...)',
    },
    "asupervisor/_training/fit.py": {
        # Compiled metrics make their variables at the first batch; a resumed epoch gives
        # back their running state before it, so they are built as Keras builds them under
        # a strategy (no public build of them alone).
        'getattr(self.model, "_compile_metrics", ...)',
        "self.model._symbolic_build",
    },
}
# Documented functions of the standard library whose names start with an underscore.
DOCUMENTED = {"os._exit", "sys._current_frames"}
# Private names imported from another module, by module.
PRIVATE_IMPORTS: dict[str, set[str]] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reaches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, expression)`` of every read of a private member of something that is not
    ``self``, ``cls`` or ``super()``: ``obj._x``, ``getattr(obj, "_x")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
                continue
            text = ast.unparse(node)
            if text not in DOCUMENTED:
                yield node.lineno, text
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
        ):
            rest = ", ..." if len(node.args) > 2 else ""
            name = node.args[1].value
            yield node.lineno, f'{node.func.id}({ast.unparse(node.args[0])}, "{name}"{rest})'


def private_imports(tree: ast.AST, path: Path) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of every private name imported from another module; a private
    submodule (``from .. import _exit``) is not a name of a module but the module."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
        else:
            base = ROOT
        package = base.joinpath(*(node.module or "").split(".")) if node.module else base
        for alias in node.names:
            if not _private(alias.name):
                continue
            submodule = package / alias.name
            if submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists():
                continue
            yield node.lineno, alias.name


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_module_reaches_into_another_objects_private_members(path: Path) -> None:
    tree = ast.parse(path.read_text())
    allowed = REACHES.get(where(path), set())
    found = [(line, text) for line, text in reaches(tree) if text not in allowed]
    assert found == [], f"{where(path)} reads private members it does not own: {found}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    allowed = PRIVATE_IMPORTS.get(where(path), set())
    found = [
        (line, name)
        for line, name in private_imports(ast.parse(path.read_text()), path)
        if name not in allowed
    ]
    assert found == [], f"{where(path)} imports private names of another module: {found}"


def test_the_allowed_reaches_are_still_there() -> None:
    """An allowance whose reach is gone is removed, not left to cover a new one."""
    for module, allowed in REACHES.items():
        found = {text for _, text in reaches(ast.parse((ROOT / module).read_text()))}
        assert allowed <= found, f"{module}: no longer reads {sorted(allowed - found)}"
    for module, names in PRIVATE_IMPORTS.items():
        path = ROOT / module
        found = {name for _, name in private_imports(ast.parse(path.read_text()), path)}
        assert names <= found, f"{module}: no longer imports {sorted(names - found)}"


def test_the_checkers_find_reaches_and_private_imports(tmp_path: Path) -> None:
    code = (
        "class A:\n    def m(self, other):\n        self._mine()\n        super()._base()\n"
        "        other._theirs()\n        self.part._inner\n"
        "        getattr(other, '_hidden', None)\n        getattr(self, '_own')\n"
    )
    assert sorted(reaches(ast.parse(code))) == [
        (5, "other._theirs"),
        (6, "self.part._inner"),
        (7, 'getattr(other, "_hidden", ...)'),
    ]
    package = tmp_path / "pkg"
    (package / "_sub").mkdir(parents=True)
    (package / "_sub" / "__init__.py").write_text("")
    (package / "_mod.py").write_text("")
    module = package / "user.py"
    imports = "from . import _mod, _sub\nfrom ._mod import _helper, public\n"
    assert list(private_imports(ast.parse(imports), module)) == [(2, "_helper")]


ENUM_VALUES = {m.value for e in (StopReason, JobKind, Outcome) for m in e}


def string_comparisons(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in ENUM_VALUES:
                    yield node.lineno, ast.unparse(node)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kinds_reasons_and_outcomes_are_compared_only_as_enums(path: Path) -> None:
    found = list(string_comparisons(ast.parse(path.read_text())))
    assert found == [], f"{path.name} compares an enum's value as a string: {found}"


def phase_assignments(tree: ast.AST) -> Iterator[tuple[str, int, str]]:
    """``(function, line, value)`` of every assignment to an attribute named ``phase``."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = [(target, node.value) for target in node.targets]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                pairs = [(node.target, node.value)]
            else:
                continue
            for target, value in pairs:
                for attr in ast.walk(target):
                    if isinstance(attr, ast.Attribute) and attr.attr == "phase":
                        yield fn.name, node.lineno, ast.unparse(value)


def test_the_phase_changes_only_through_the_stop_paths_one_guarded_method() -> None:
    """``StopPath.move`` checks every transition against the machine; nothing else may
    set a phase (its ``__init__`` sets the first one)."""
    found = {
        (path.relative_to(ROOT).as_posix(), fn, value)
        for path in SOURCES
        for fn, _, value in phase_assignments(ast.parse(path.read_text()))
    }
    stop_path = "asupervisor/_session/stoppath.py"
    assert found == {(stop_path, "__init__", "Phase.STARTING"), (stop_path, "move", "to")}


def test_the_phase_checker_finds_an_assignment() -> None:
    code = "def close(rt):\n    rt.phase = Phase.CLOSED\n"
    assert list(phase_assignments(ast.parse(code))) == [("close", 2, "Phase.CLOSED")]


@pytest.mark.parametrize(
    ("path", "wrong"),
    [
        ([Phase.RUNNING], Phase.STARTING),
        ([], Phase.FINISHING),
        ([Phase.RUNNING, Phase.DRAINING, Phase.CLOSING], Phase.CLOSING),
        ([Phase.CLOSING, Phase.CLOSED], Phase.RUNNING),
    ],
)
def test_a_wrong_phase_transition_is_an_error_naming_both(path: list[Phase], wrong: Phase) -> None:
    from asupervisor._session.stoppath import StopPath

    # The transitions need none of the collaborators.
    stop = StopPath(None, None, None, 1.0, None, None, None)  # type: ignore[arg-type]
    for phase in path:
        stop.move(phase)
    with pytest.raises(RuntimeError, match=f"from {stop.phase.value} to {wrong.value}"):
        stop.move(wrong)


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every absolute import (relative imports stay in the package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module


@pytest.mark.parametrize("path", sorted(ROOT.glob("services/*.py")), ids=lambda p: p.name)
def test_the_standard_services_use_only_the_public_api(path: Path) -> None:
    """services/ is what a user's own service can be: it imports ``asupervisor`` (the
    public API), its own package and other libraries, never a private module of ours."""
    found = [
        (line, module)
        for line, module in imported_modules(ast.parse(path.read_text()))
        if module.split(".")[0] == "asupervisor" and module != "asupervisor"
    ]
    assert found == [], f"{where(path)} imports private modules of asupervisor: {found}"


def test_the_services_checker_finds_a_private_import() -> None:
    tree = ast.parse("import os\nfrom asupervisor import logger\nfrom asupervisor._log import x\n")
    assert [m for _, m in imported_modules(tree) if m.startswith("asupervisor.")] == [
        "asupervisor._log"
    ]


def test_the_services_sit_at_the_top_level_and_are_the_packages_services() -> None:
    import asupervisor.services

    assert (ROOT / "services" / "__init__.py").is_file()
    assert Path(asupervisor.services.__file__).resolve().parent == (ROOT / "services").resolve()
