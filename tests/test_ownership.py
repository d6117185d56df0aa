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

from asupervisor._kinds import JobKind
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
