"""The code's own rules, checked on its source: one owner per piece of state, typed protocols.

- No module assigns another object's attributes: only ``self`` (or ``cls``) is assigned
  to, or an object the same function has just made (a message, an exception, a module it
  builds). What a third party's API says to set is listed below, with why.
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
SOURCES = sorted(ROOT.glob("asupervisor/**/*.py"))

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
