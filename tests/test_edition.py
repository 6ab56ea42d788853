"""The student edition (``python -m distlab.grading.course release OUT --through NN``):
what it holds, and that no later lab's answer is in any of its files (normalised ASTs of
functions and classes, not file names). That its grader gives the solutions of the lab
being worked on full marks is ``test_grading_solutions.py``'s part (it grades labs 00,
01, 05 and 10 inside the editions through none, 00, 04 and 09); that every lab runs top
to bottom in the edition its students have is nbval's: each solution notebook runs
inside the edition through the lab before it (``editions.EditionKernels``), and an
edition through a later lab holds every module that one holds."""
from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.grading import answers, edition as editions, labs
from editions import ROOT, THROUGH, edition

LABS = labs.exercises()


def _label(through: int) -> str:
    return "none" if through < 0 else f"{through:02d}"


def _normalised(node) -> str:
    """A function or class as its AST with its name, docstrings and positions left out."""
    node = ast.parse(ast.unparse(node)).body[0]  # a copy, positions dropped below
    for each in ast.walk(node):
        body = getattr(each, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            each.body = body[1:] or [ast.Pass()]
    node.name = "_"
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def _definitions(tree) -> set[str]:
    """Every function, method and class defined anywhere in ``tree``, normalised."""
    return {_normalised(n) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _answer_code(exercises) -> dict[str, str]:
    """``module:name`` → normalised AST of each library answer to ``exercises`` (a class
    also by each of its methods), read from the full kit's files."""
    found = {}
    for exercise in exercises:
        for ref in answers.ANSWERS[exercise]:
            module, name = ref.split(":")
            source = ROOT / "lib" / Path(*module.split(".")).with_suffix(".py")
            tree = ast.parse(source.read_text())
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                    found[ref] = _normalised(node)
                    methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
                    for part in methods:
                        found[f"{ref}.{part.name}"] = _normalised(part)
    return found


@functools.lru_cache(maxsize=None)
def _definitions_of(source: str) -> frozenset[str]:
    try:
        return frozenset(_definitions(ast.parse(source)))
    except SyntaxError:  # a cell of IPython magics: no Python definitions to find
        return frozenset()


def _code_in(folder: Path) -> set[str]:
    """The normalised definitions of every Python file and notebook code cell in ``folder``
    (each text parsed once per process: the editions share most files)."""
    found: set[str] = set()
    for path in folder.rglob("*"):
        if path.suffix == ".py":
            sources = [path.read_text()]
        elif path.suffix == ".ipynb":
            sources = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                       if c["cell_type"] == "code"]
        else:
            continue
        for source in sources:
            found |= _definitions_of(source)
    return found


def _later(through: int) -> list[str]:
    return [e for lab, names in LABS.items() if editions.lab_number(lab) > through for e in names]


@pytest.mark.parametrize("through", THROUGH, ids=_label)
def test_an_edition_holds_the_kit_but_the_later_answers_solutions_and_developers_tests(through):
    out = edition(through)
    assert not (out / "solutions").exists() and not (out / "tests").exists()
    assert not (out / ".ci").exists() and not (out / ".github").exists()
    assert sorted(p.name for p in (out / "labs").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "labs").glob("*.ipynb"))
    for name in ("Makefile", "pyproject.toml"):
        assert (out / name).read_bytes() == (ROOT / name).read_bytes()
    assert (out / "README.md").read_text().startswith("> **Student edition**")
    withheld = json.loads((out / "lib" / "distlab" / editions.MANIFEST).read_text())["withheld"]
    assert set(withheld) == set(answers.modules_of(_later(through)))  # out with their last lab
    for module in withheld:
        base = out / "lib" / Path(*module.split("."))
        assert not base.with_suffix(".py").exists() and not base.exists(), module
    for module in set(answers.hidden_modules()) - set(withheld):  # released: there as in the kit
        path = Path("lib", *module.split(".")).with_suffix(".py")
        assert (out / path).read_bytes() == (ROOT / path).read_bytes(), module


@pytest.mark.parametrize("through", THROUGH, ids=_label)
def test_no_later_answer_is_in_any_file_of_the_edition(through):
    """Every function and class of the edition (library, grader and its tests, labs, docs,
    tools) against the later labs' answers, compared as normalised ASTs; the earlier
    labs' answers are there."""
    out = edition(through)
    code = _code_in(out)
    later = _answer_code(_later(through))
    assert later
    assert not {ref for ref, ast_ in later.items() if ast_ in code}, "later answers found"
    withheld = set(answers.modules_of(_later(through)))
    released = {ref: ast_ for ref, ast_ in _answer_code(answers.ANSWERS).items()
                if ref.split(":")[0] not in withheld}
    missing = [ref for ref, ast_ in released.items() if ast_ not in code]
    assert not missing, f"released answers missing: {missing}"
    assert released or through <= 0  # lab 00's exercise has no library answer


def test_the_search_finds_a_later_answer_wherever_it_is_pasted(tmp_path):
    """The check above can fail: an answer renamed, its docstring changed and pasted into
    a notebook cell is found."""
    ref = answers.ANSWERS["gpipe_schedule"][0]
    module, name = ref.split(":")
    tree = ast.parse((ROOT / "lib" / Path(*module.split(".")).with_suffix(".py")).read_text())
    node = next(n for n in tree.body if getattr(n, "name", None) == name)
    node.name = "my_own_schedule"
    cell = {"cell_type": "code", "source": ast.unparse(node), "metadata": {}, "outputs": [],
            "execution_count": None}
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert _answer_code(["gpipe_schedule"])[ref] in _code_in(tmp_path)


def _run(code: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(out / "lib")}
    return subprocess.run([sys.executable, "-c", code], cwd=out, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_withheld_answer_imports_as_a_refusal_that_names_its_lab():
    out = edition(4)
    done = _run("import distlab, distlab.tp as tp\n"
                "print(distlab.__file__)\n"
                "try:\n    tp.ColumnParallelLinear\n    tp.ColumnParallelLinear(None, None)\n"
                "except RuntimeError as e:\n    print(e)\n", out)
    assert done.returncode == 0, done.stderr
    where, refusal = done.stdout.splitlines()
    assert where == str(out / "lib" / "distlab" / "__init__.py")
    assert "not in this edition of the kit: it answers lab 06_tensor_parallel" in refusal


@pytest.mark.parametrize("bad, says", [("11", "none' or a lab's number"),
                                       ("four", "none' or a lab's number")])
def test_a_bad_through_or_an_existing_folder_is_refused(tmp_path, bad, says, capsys):
    from distlab.grading import course

    with pytest.raises(SystemExit):
        course.main(["release", str(tmp_path / "x"), "--through", bad])
    assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        course.main(["release", str(tmp_path), "--through", "none"])
    assert "exists: name a new folder" in capsys.readouterr().err
