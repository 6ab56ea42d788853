"""Exercise cells, the student release, and its staleness check."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from distlab.grading import labs, notebook, runner

ROOT = Path(__file__).resolve().parents[1]

ANSWER = '''import math

# EXERCISE
def area(r):
    """Area of a circle."""
    ### BEGIN SOLUTION
    squared = r * r
    return math.pi * squared
    ### END SOLUTION
'''


def _nb(*sources):
    cells = [new_markdown_cell("# A lab"), new_code_cell("import math\n%matplotlib inline")]
    for name, source in sources:
        cell = new_code_cell(source, outputs=[new_output("stream", name="stdout", text="x")],
                             execution_count=3)
        cell.metadata["nbgrader"] = {"solution": True, "grade_id": name}
        cells.append(cell)
    return new_notebook(cells=cells)


def test_release_replaces_answers_with_stubs_at_their_indentation():
    released = notebook.clear_solutions(ANSWER)
    assert "    raise NotImplementedError" in released
    assert "squared" not in released and "BEGIN SOLUTION" not in released
    assert '"""Area of a circle."""' in released and released.startswith("import math")
    assert notebook.is_untouched(released) and not notebook.is_untouched(ANSWER)


def test_release_drops_outputs_and_keeps_metadata():
    solved = _nb(("area", ANSWER))
    solved.cells[2].metadata["execution"] = {"iopub.status.idle": "2026-12-02T00:30:38Z"}
    nb = notebook.release(solved)
    cell = nb.cells[2]
    assert cell.outputs == [] and cell.execution_count is None
    assert notebook.grade_id(cell) == "area" and "execution" not in cell.metadata


def test_module_source_has_the_notebook_imports_and_survives_a_broken_cell():
    nb = _nb(("area", ANSWER), ("broken", "def broken(:\n    pass"))
    namespace = {}
    exec(notebook.module_source(nb), namespace)
    assert namespace["area"](1.0) == pytest.approx(3.14159, rel=1e-5)
    with pytest.raises(SyntaxError, match=r"broken does not compile \(line 1, column 12 of "
                                          r"your broken cell: invalid syntax\)"):
        namespace["broken"]()


# (cell source, the line Python stops at, the character its caret must sit under there):
# a magic line first (blanked, so the lines below keep their numbers), a tab, a form feed
BROKEN = [("%load_ext autoreload\ndef f():\n    m = 1\n    x = (1,\n    return [[]]\n", 4, "("),
          ("def f(x):\n\tif x:\n\t\treturn (x +)\n", 3, ")"),
          ("%time\n# one\x0c# page\ndef f():\n    return [1, 2 3]\n", 4, "2")]


@pytest.mark.parametrize("source, line, char", BROKEN)
def test_a_cell_that_does_not_compile_is_named_at_the_students_line_and_column(
        source, line, char):
    problem = notebook.compile_problem("f", source)
    where, shown, caret = problem.split("\n")
    code = source.split("\n")[line - 1]
    column = code.rindex(char) + 1  # characters, as the cell's editor counts them
    assert where.startswith(f"line {line}, column {column} of your f cell: "), problem
    assert shown.strip() == code.strip().expandtabs(8) and shown.startswith("    ")
    assert shown[caret.index("^")] == char, f"the caret is not under {char!r}:\n{problem}"
    fixed = source.replace(code, code[:len(code) - len(code.lstrip())] + "pass")
    assert notebook.compile_problem("f", fixed) == ""


def test_a_cell_nested_too_deeply_to_compile_says_so():
    problem = notebook.compile_problem("f", "def f():\n    return " + "+".join(["1"] * 100_000))
    assert problem.startswith("your f cell is nested too deeply for Python to compile it"), \
        problem


def test_labs_are_the_release_of_the_solutions():
    assert notebook.stale(ROOT / "solutions", ROOT / "labs") == [], "run `make labs`"
    solutions = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert solutions == sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))


def test_stale_detects_a_changed_solution(tmp_path):
    (tmp_path / "s").mkdir()
    nbformat.write(_nb(("area", ANSWER)), tmp_path / "s" / "01.ipynb")
    notebook.release_dir(tmp_path / "s", tmp_path / "l")
    assert notebook.stale(tmp_path / "s", tmp_path / "l") == []
    nbformat.write(_nb(("area", ANSWER.replace("pi", "tau"))), tmp_path / "s" / "01.ipynb")
    assert notebook.stale(tmp_path / "s", tmp_path / "l") == ["01.ipynb"]


CHANGED = ANSWER.replace("circle", "disc")  # a solution changed where its lab shows it


def _released(tmp_path, answer=ANSWER):
    """solutions/ with one notebook, and labs/ released from it: the lab's path."""
    (tmp_path / "s").mkdir(exist_ok=True)
    nbformat.write(_nb(("area", answer)), tmp_path / "s" / "01.ipynb")
    notebook.release_dir(tmp_path / "s", tmp_path / "l")
    return tmp_path / "l" / "01.ipynb"


def _edit(path, unstamped=False):
    """A student's answer typed into the lab at ``path`` (the release's stamp dropped where
    ``unstamped``, as in labs released before there were stamps)."""
    nb = nbformat.read(path, as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace("raise NotImplementedError", "return 3 * r * r")
    if unstamped:
        del nb.metadata["distlab"]
    nbformat.write(nb, path)
    return path.read_bytes()


@pytest.mark.parametrize("unstamped", [False, True])
def test_the_release_refuses_to_overwrite_an_edited_lab(tmp_path, capsys, unstamped):
    lab = _released(tmp_path)
    edited = _edit(lab, unstamped)
    nbformat.write(_nb(("area", CHANGED)), tmp_path / "s" / "01.ipynb")
    with pytest.raises(notebook.EditedLabs) as info:
        notebook.release_dir(tmp_path / "s", tmp_path / "l")
    assert info.value.paths == [lab] and lab.read_bytes() == edited
    assert notebook.main(["release", str(tmp_path / "s"), str(tmp_path / "l")]) == 1
    said = capsys.readouterr().err
    assert str(lab) in said and "make labs FORCE=1" in said, said
    assert lab.read_bytes() == edited and not (tmp_path / "l" / notebook.BACKUP).exists()


def test_a_forced_release_keeps_a_copy_of_each_edited_lab_then_writes(tmp_path, monkeypatch):
    lab = _released(tmp_path)
    edited = _edit(lab)
    monkeypatch.setattr(notebook.time, "strftime", lambda _: "20260102-030405")  # one second
    _, kept = notebook.release_dir(tmp_path / "s", tmp_path / "l", force=True)
    assert kept[lab].read_bytes() == edited, "the copy holds the student's work"
    assert notebook.fingerprint(nbformat.read(lab, as_version=4)) == \
        notebook.fingerprint(notebook.release(_nb(("area", ANSWER))))
    again = _edit(lab)
    _, kept_again = notebook.release_dir(tmp_path / "s", tmp_path / "l", force=True)
    assert kept_again[lab] != kept[lab] and kept[lab].read_bytes() == edited, \
        "a second copy in the same second never overwrites the first"
    assert kept_again[lab].read_bytes() == again
    assert [p.name for p in (tmp_path / "l").glob("*.ipynb")] == ["01.ipynb"], \
        "labs/*.ipynb finds no copy"


def test_an_unedited_lab_is_rewritten_when_its_solution_changes(tmp_path):
    lab = _released(tmp_path)
    _released(tmp_path, CHANGED)  # no refusal
    nb = nbformat.read(lab, as_version=4)
    assert "disc" in nb.cells[2].source
    assert notebook.stamp(nb) == notebook.fingerprint(nb), "the lab is stamped with its cells"


def test_opening_and_running_a_lab_is_not_an_edit(tmp_path):
    lab = _released(tmp_path)
    nb = nbformat.read(lab, as_version=4)
    stamped = notebook.fingerprint(nb)
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7"}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    for cell in nb.cells:
        cell.metadata.update(collapsed=False, scrolled=True)
        if cell.cell_type == "code":
            cell.execution_count = 7
            cell.metadata["execution"] = {"iopub.status.idle": "2026-12-02T00:30:38Z"}
            cell.outputs = [new_output("error", ename="NotImplementedError", evalue="",
                                       traceback=[])]
    nbformat.write(nb, lab)
    assert notebook.fingerprint(nb) == stamped
    _released(tmp_path, CHANGED)  # no refusal
    assert "disc" in nbformat.read(lab, as_version=4).cells[2].source


def test_every_solution_exercise_has_autograder_tests():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for name in notebook.exercises(nbformat.read(path, as_version=4)):
            assert (runner.TESTS / f"test_{name}.py").exists(), (path.name, name)


# The autograder imports a lab's exercise cells with the notebook's imports: that must not
# need ipywidgets (nor matplotlib where the lab's cells do not import it). Labs that block
# the same packages are checked in one interpreter, each module in a namespace of its own.
WITHOUT = {"01_primitives": ("ipywidgets",), "02_parameter_server": ("ipywidgets",),
           "03_ring_allreduce": ("ipywidgets", "matplotlib"),
           "05_zero": ("ipywidgets", "matplotlib"), "07_pipeline_parallel": ("ipywidgets",)}

BLOCK = """
import importlib.abc, sys, traceback
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked")
sys.meta_path.insert(0, Block())
for lab, source in {sources!r}.items():
    try:
        exec(compile(source, lab, "exec"), {{"__name__": "student"}})
        print(lab, "imports")
    except BaseException:
        print(lab, "fails:", traceback.format_exc()[-2000:].replace("\\n", " | "))
"""


@pytest.fixture(scope="module")
def imported_without():
    """Lab → what importing its exercise module printed, with its packages blocked."""
    sets: dict[tuple, dict] = {}
    for lab, blocked in WITHOUT.items():
        nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", 4)
        sets.setdefault(blocked, {})[lab] = notebook.module_source(nb)
    said = {}
    for blocked, sources in sets.items():
        run = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=set(blocked),
                                                                  sources=sources)],
                             capture_output=True, text=True, timeout=120)
        for lab in sources:
            line = next((x for x in run.stdout.splitlines() if x.startswith(lab + " ")),
                        f"{lab} not reached: {run.stderr[-2000:]}")
            said[lab] = line
    return said


@pytest.mark.parametrize("lab", WITHOUT)
def test_the_exercise_modules_import_without_widgets(lab, imported_without):
    assert imported_without[lab] == f"{lab} imports", imported_without[lab]


def test_each_lab_and_the_readme_list_the_graders_exercises_and_points():
    """What `make labs` writes from the grader's own list is what they hold: no exercise
    left out (lab 10's fp8_linear once was), no point count drifted."""
    stale = labs.render(ROOT / "solutions", ROOT / "README.md", write=False)  # ~8 CPU-s
    assert not stale, (f"{stale} do not list the grader's exercises and points: run "
                       f"`make labs` (python -m distlab.grading.labs render)")


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_a_submission_reads_as_nbformat_reads_it(path):
    """The grader's own reader (no nbformat) sees the exercises, imports and cells that
    nbformat sees, in a notebook saved with its sources split into lines."""
    split = nbformat.read(path, as_version=4)
    raw = nbformat.writes(split)  # nbformat writes each source as a list of lines
    assert any(isinstance(c["source"], list) for c in json.loads(raw)["cells"])
    mine = notebook.parse(raw.encode())
    assert notebook.exercises(mine) == notebook.exercises(split)
    assert notebook.imports(mine) == notebook.imports(split)
    assert notebook.fingerprint(mine) == notebook.fingerprint(split)


@pytest.mark.parametrize("text, why", [
    ('{"nbformat": 3, "cells": []}', "not an nbformat 4"),
    ('{"nbformat": 4, "metadata": [], "cells": []}', "not an object"),
    ('{"nbformat": 4, "cells": [1]}', "not an object"),
    ('{"nbformat": 4, "cells": [{"cell_type": "code"}]}', "text source"),
    ('{"nbformat": 4, "cells": [{"cell_type": "code", "source": ["a", 1]}]}', "text source"),
    ('{"nbformat": 4, "cells": [{"cell_type": "widget", "source": ""}]}', "known type"),
    ('[' * 100_000, "recursion"),
])
def test_a_file_that_is_no_notebook_is_refused_naming_the_fix(tmp_path, text, why):
    path = tmp_path / "00_setup.ipynb"
    path.write_text(text)
    with pytest.raises(notebook.SubmissionError, match="is not a readable notebook.*save it"):
        notebook.read_submission(path)
    with pytest.raises((ValueError, RecursionError), match=f"(?i){why}"):
        notebook.parse(text.encode())


def test_exercise_metadata_of_the_wrong_type_names_no_exercise():
    nb = notebook.parse(b'{"nbformat": 4, "cells": [{"cell_type": "code", "source": "x", '
                        b'"metadata": {"nbgrader": {"solution": true, "grade_id": [1]}}}, '
                        b'{"cell_type": "code", "source": "y", "metadata": {"nbgrader": 7}}]}')
    assert notebook.exercises(nb) == {}


def test_imports_keeps_each_import_once_in_the_order_first_seen():
    nb = new_notebook(cells=[
        new_code_cell("import torch\nfrom math import pi\n%time x = 1"),
        new_markdown_cell("import os"),
        new_code_cell("import os\nimport torch\nfrom math import pi as p\n"
                      "def f():\n    import sys")])
    assert notebook.imports(nb) == ["import torch", "from math import pi", "import os",
                                    "from math import pi as p"]
