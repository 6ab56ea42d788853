"""No answer where a lab sends students to read (issue 32).

A module a lab shows a student (``labs/*.ipynb``, the notebooks students get: named in
its markdown, imported by its code cells, or imported from by the ``__init__`` of such a
package) may hold only what students may use: it defines no graded exercise's name, and
no function or method in it has the body of an exercise's reference (the solution's
exercise cell, or the library code :data:`distlab.grading.answers.ANSWERS` refuses while
grading it) under another name. Bodies are compared as ASTs with the docstring dropped
and the local names renamed in order of appearance, so renaming variables does not hide
a copy. The answers
live in the modules :data:`~distlab.grading.answers.ANSWERS` names, which the labs name only to say that reading them before
grading defeats the exercise; they are not checked here.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from distlab.grading import labs, notebook
from distlab.grading.answers import hidden_modules, modules_of as answer_modules

ROOT = Path(__file__).resolve().parents[1]
MODULE = re.compile(r"\bdistlab(?:\.[A-Za-z_]\w*)+")
SMALLEST = 12   # AST nodes: shorter bodies (a return, an attribute) are not an answer

def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None


def _private(name: str) -> bool:
    """The answers' modules: those of the manifest, each holding only answers, absent
    while their exercise is graded."""
    return name in hidden_modules()


def submodules(package: str) -> set[str]:
    """The modules of ``package`` that its ``__init__`` imports from: what a student
    reading a named package opens next (``distlab.moe`` → ``distlab.moe.layer``)."""
    path = _module_file(package)
    if path is None or path.name != "__init__.py":
        return set()
    return {node.module for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith(package + ".") and _module_file(node.module)}


def _mentioned(cell) -> set[str]:
    """The ``distlab`` modules a cell shows a student: in markdown, the longest importable
    prefix of each dotted ``distlab.…`` name; in code, what its imports import."""
    found = set()
    if cell.cell_type == "markdown":
        for dotted in MODULE.findall(cell.source):
            parts = dotted.split(".")
            for end in range(len(parts), 1, -1):
                if _module_file(".".join(parts[:end])):
                    found.add(".".join(parts[:end]))
                    break
        return found
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("distlab."))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distlab"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(m for m in names if m != "distlab" and _module_file(m))
    return found


def named_modules(lab_dir: Path = ROOT / "labs") -> dict[str, set[str]]:
    """Module → the labs that show it to a student (:func:`_mentioned`: named in
    markdown or imported by a code cell), or show the package whose ``__init__`` imports
    from it (:func:`submodules`); the answers' modules (:func:`_private`) left out."""
    found: dict[str, set[str]] = {}
    for path in sorted(lab_dir.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for name in _mentioned(cell):
                for module in {name} | submodules(name):
                    if not _private(module):
                        found.setdefault(module, set()).add(path.stem)
    return found


class _Renamer(ast.NodeTransformer):
    """Local names (variables, arguments) → v0, v1, ... in order of appearance."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def _new(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id=self._new(node.id), ctx=node.ctx), node)

    def visit_arg(self, node):
        return ast.copy_location(ast.arg(arg=self._new(node.arg)), node)


def body_key(fn: ast.AST) -> str | None:
    """The normalized body of a function (None when too short to be an answer)."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                           ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if sum(1 for stmt in body for _ in ast.walk(stmt)) < SMALLEST:
        return None
    tree = ast.Module(body=[_Renamer().visit(ast.parse(ast.unparse(stmt)).body[0])
                            for stmt in body], type_ignores=[])
    return ast.dump(tree, annotate_fields=False)


def functions(tree: ast.AST):
    """Every function and method in ``tree``, with its qualified name."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def reference_bodies(solutions: Path = ROOT / "solutions") -> dict[str, str]:
    """Normalized body → "exercise (where)", for every function of every exercise's
    solution cell (but those the lab hands out whole, outside the answer's regions: a
    skeleton's ``forward``) and of the library code that answers it."""
    bodies: dict[str, str] = {}
    for path in sorted(solutions.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            name = notebook.grade_id(cell)
            if cell.cell_type == "code" and name:
                given = {body_key(fn) for _, fn in functions(
                    ast.parse(notebook.clear_solutions(cell.source)))}
                for qual, fn in functions(ast.parse(cell.source)):
                    if (key := body_key(fn)) and key not in given:
                        bodies.setdefault(key, f"{name} (solutions/{path.name}: {qual})")
    for exercise, refs in labs.ANSWERS.items():
        for ref in refs:
            module, name = ref.split(":")
            tree = ast.parse(_module_file(module).read_text())
            for qual, fn in functions(tree):
                if qual == name or qual.startswith(name + "."):
                    if (key := body_key(fn)):
                        bodies.setdefault(key, f"{exercise} ({module}:{qual})")
    return bodies


def answers_in(source: str, exercise_names: set[str], bodies: dict[str, str]) -> list[str]:
    """What in ``source`` is an answer: a definition named like an exercise, or a
    function whose body is a reference's."""
    tree = ast.parse(source)
    found = [f"defines {node.name}, a graded exercise" for node in ast.walk(tree)
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and node.name in exercise_names]
    for qual, fn in functions(tree):
        if (key := body_key(fn)) in bodies:
            found.append(f"{qual} has the body of {bodies[key]}")
    return found


@pytest.fixture(scope="module")
def kit():
    names = {n for lab in labs.exercises().values() for n in lab}
    return names, reference_bodies()


def test_the_labs_name_modules_and_the_check_sees_them():
    named = named_modules()
    assert {"distlab.zero", "distlab.dp", "distlab.zero.memory"} <= set(named), sorted(named)
    assert "distlab.moe.layer" in named, "a named package's submodules are named too"
    assert not set(named) & set(hidden_modules())


def test_no_module_a_lab_names_holds_an_answer(kit):
    names, bodies = kit
    found = {}
    for module, where in sorted(named_modules().items()):
        bad = answers_in(_module_file(module).read_text(), names, bodies)
        if bad:
            found[f"{module} (shown by {', '.join(sorted(where))})"] = bad
    assert not found, ("modules the labs show students hold answers; move them to "
                       f"a module of answers the manifest names: {found}")


def test_the_check_finds_a_copied_answer_under_another_name(kit):
    """The check can fail: zero2_step's and DataParallel's code pasted under other names
    and other variable names, and a class named like an exercise, are each found."""
    names, bodies = kit
    source = (ROOT / "lib/distlab/zero/step.py").read_text()
    tree = ast.parse(source)
    step = next(fn for qual, fn in functions(tree) if qual == "zero2_step")
    step.name = "sharded_adamw_update"
    renamed = ast.unparse(step).replace("layout", "lay").replace("shard", "piece")
    found = answers_in(renamed, names, bodies)
    assert found and "zero2_step" in found[0], found
    dp = ast.parse((ROOT / "lib/distlab/dp/bucketed.py").read_text())
    launch = next(fn for qual, fn in functions(dp) if qual == "DataParallel._launch")
    launch.name = "issue"
    found = answers_in(ast.unparse(launch), names, bodies)
    assert found and "DataParallel._launch" in found[0], found
    assert answers_in("class ZeRO3Unit:\n    pass\n", names, bodies) == [
        "defines ZeRO3Unit, a graded exercise"]


def test_each_lab_names_the_modules_that_hold_its_answers():
    """Each lab's first cell names, once, exactly the modules of the manifest that answer
    its exercises, and says that reading them before grading defeats the exercise."""
    for lab, names in labs.exercises().items():
        text = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", as_version=4).cells[0].source
        held = answer_modules(names)
        for module in held:
            assert text.count(f"`{module}`") == 1, (lab, module)
        assert ("defeats the exercise" in text) == bool(held), lab

