"""The kit's own account of the labs: each lab's exercises, and the library's answers.

The grader takes every maximum from the kit, never from the student's notebook: a lab's
exercises are those whose test file (``exercises/test_<name>.py``, installed with the
package, out of the student's reach) declares ``NOTEBOOK = "<lab>"`` (:func:`exercises`).
A notebook is the lab whose name its file name starts with (``05_zero.ipynb``,
``05_zero-alice.ipynb``, ``05_zero (1).ipynb``); a file name that starts with no lab's
name is not graded at all (:func:`lab_of` gives None; the grader reports an error).

:data:`~distlab.grading.answers.ANSWERS` (the answers' manifest) names, per exercise,
the library code that answers it (in the labs' order, which is the order of the
report). While an exercise is graded, the modules holding its answers are absent from
the processes that run the student's code (:mod:`distlab.runtime.absent`), and where
graded ranks are sandboxed the source files of every answer module are absent from
their filesystem (:func:`distlab.grading.answers.hidden_modules`).

``python -m distlab.grading.labs check solutions`` exits 1 when the exercise tests,
``solutions/`` and :data:`ANSWERS` disagree (:func:`problems`); ``... render solutions
--readme README.md`` writes each lab's graded exercises and their points (one per test,
:func:`test_counts`) into its first cell and the README (:func:`render`; ``make labs``).
"""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

from distlab.grading import answers
from distlab.grading.answers import ANSWERS

TESTS = Path(__file__).resolve().parent / "exercises"



def exercises(tests_dir: Path = TESTS) -> dict[str, tuple[str, ...]]:
    """Lab → its exercises: every ``test_<name>.py`` of ``tests_dir`` whose ``NOTEBOOK``
    names the lab, in the order of :data:`ANSWERS` (others after, by name)."""
    order = {name: i for i, name in enumerate(ANSWERS)}
    found: dict[str, list[str]] = {}
    for test in sorted(Path(tests_dir).glob("test_*.py")):
        lab = declared_lab(test)
        if lab:
            found.setdefault(lab, []).append(test.stem.removeprefix("test_"))
    return {lab: tuple(sorted(names, key=lambda n: (order.get(n, len(order)), n)))
            for lab, names in sorted(found.items())}


def lab_of(path, labs=None) -> str | None:
    """The lab a notebook file is (its file name starts with the lab's name, then
    anything but a letter or digit), or None. ``labs``: :func:`exercises`'s answer."""
    stem = Path(path).stem
    for lab in sorted(labs if labs is not None else exercises(), key=len, reverse=True):
        if stem == lab or (stem.startswith(lab) and not stem[len(lab)].isalnum()):
            return lab
    return None


def unknown_lab_message(path, labs=None) -> str:
    labs = labs if labs is not None else exercises()
    return (f"{Path(path).name} is not one of the labs: the file name must start with a lab's "
            f"name ({', '.join(f'{lab}.ipynb' for lab in labs)}); nothing was graded. Keep the "
            f"name the lab was handed out with")


# ----------------------------------------------------------------- the kit agrees


def _declared(test_file: Path, name: str):
    """The literal a test file assigns to ``name`` at its top level (read, never
    imported), or None."""
    for node in ast.parse(test_file.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def declared_lab(test_file: Path) -> str | None:
    """The ``NOTEBOOK = "..."`` a test file declares."""
    lab = _declared(test_file, "NOTEBOOK")
    return lab if isinstance(lab, str) else None


def rank_imports(test_file: Path) -> tuple[str, ...]:
    """The modules a test file's ranks import after they start (``RANK_IMPORTS = (...)``:
    torch's optimizers import ``torch._dynamo``, ~1 CPU-s, at their first step), which
    the graded ranks' fork server imports once for all of them
    (:func:`distlab.grading.sandbox.rank_sandbox`)."""
    names = _declared(test_file, "RANK_IMPORTS") or ()
    return tuple(n for n in names if isinstance(n, str))


def is_core(test_file: Path) -> bool:
    """Whether a test file declares its exercise a lab's core one (``CORE = True``)."""
    return _declared(test_file, "CORE") is True


# a pytest run that prints each collected test's exercise and whether a GPU tier marks it
_COUNT = """
import sys, pytest
class Tiers:
    def pytest_collection_modifyitems(self, items):
        for item in items:
            gpu = any(item.get_closest_marker(m) for m in ("gpu", "multigpu"))
            print("TIER", item.nodeid.split("::")[0], int(gpu))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
                     plugins=[Tiers()]))
"""


def test_counts(names: list[str], tests_dir: Path = TESTS) -> dict[str, tuple[int, int]]:
    """Exercise name → (its tests outside the gpu and multigpu tiers, its tests in them):
    its points on a CPU machine, and the points a machine with GPUs adds (one per test)."""
    files = [tests_dir / f"test_{name}.py" for name in names]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"no autograder tests for {', '.join(missing)} in {tests_dir}")
    run = subprocess.run([sys.executable, "-c", _COUNT, *map(str, files)], cwd=tests_dir,
                         capture_output=True, text=True, timeout=300)
    counts = {name: [0, 0] for name in names}
    for line in run.stdout.splitlines():
        if line.startswith("TIER "):
            _, path, gpu = line.split()
            name = Path(path).stem.removeprefix("test_")
            if name in counts:
                counts[name][int(gpu)] += 1
    if run.returncode or not all(cpu for cpu, _ in counts.values()):
        raise RuntimeError(f"could not count the tests of {names}:\n{run.stdout}{run.stderr}")
    return {name: (cpu, gpu) for name, (cpu, gpu) in counts.items()}


# ------------------------------------------------ the graded exercises, where users read them

BEGIN_LISTING = "<!-- graded exercises: written by `make labs` "
END_LISTING = "<!-- end of graded exercises -->"
_LISTING = re.compile(re.escape(BEGIN_LISTING) + r".*?" + re.escape(END_LISTING), re.DOTALL)
_HEADER = (f"{BEGIN_LISTING}(python -m distlab.grading.labs render) from the grader's own list; "
           f"do not edit -->")


def _points(cpu: int, gpu: int) -> str:
    return f"{cpu}" + (f" (+{gpu} with GPUs)" if gpu else "")


def _named(name: str, tests_dir: Path) -> str:
    return f"`{name}`" + (" (core)" if is_core(tests_dir / f"test_{name}.py") else "")


def lab_listing(lab: str, names, counts: dict[str, tuple[int, int]],
                tests_dir: Path = TESTS) -> str:
    """The block a lab's first cell ends with: each graded exercise (``names``) and its
    points."""
    rows = [f"| {_named(name, tests_dir)} | {_points(*counts[name])} |" for name in names]
    cpu, gpu = (sum(counts[n][i] for n in names) for i in (0, 1))
    number = lab.split("_")[0]
    held = answers.modules_of(names)
    where = [] if not held else [
        "", f"The library's answers to them are in {', '.join(f'`{m}`' for m in held)}. "
            f"Reading those before your work is graded defeats the exercise; while it is "
            f"graded they are absent from the processes that run your code, and a test that "
            f"reaches one scores 0 (\"refused\")."]
    return "\n".join([
        _HEADER,
        f"**Graded exercises** ({len(names)}; `make grade LAB={number}` grades them, one "
        f"point per test, {_points(cpu, gpu)} in all):", "",
        "| exercise | points |", "| --- | --- |", *rows, *where, END_LISTING])


def readme_listing(labs: dict, counts: dict[str, tuple[int, int]],
                   tests_dir: Path = TESTS) -> str:
    """The README's table of every lab's graded exercises (``labs``: :func:`exercises`'s
    answer) and their points."""
    rows = [f"| {lab} | " + "; ".join(f"{_named(n, tests_dir)} {_points(*counts[n])}"
                                       for n in names) + " |" for lab, names in labs.items()]
    return "\n".join([_HEADER, "| lab | graded exercises and their points |",
                      "| --- | --- |", *rows, END_LISTING])


def _with_listing(text: str, listing: str, where: str) -> str:
    if _LISTING.search(text):
        return _LISTING.sub(lambda _: listing, text, count=1)
    raise ValueError(f"{where} has no graded-exercises block: add a line "
                     f"'{BEGIN_LISTING}-->' and a line '{END_LISTING}' where it goes")


def render(solutions: Path, readme: Path | None, tests_dir: Path = TESTS,
           write: bool = True) -> list[str]:
    """Write each lab's graded exercises and points into the first cell of its solution
    notebook, and all of them into ``readme``, from the grader's own list
    (:func:`exercises`, :func:`test_counts`). Returns the files that changed (with
    ``write=False``: that would change)."""
    import nbformat

    labs = exercises(tests_dir)
    counts = test_counts([n for names in labs.values() for n in names], tests_dir)
    changed = []
    for lab in labs:
        path = Path(solutions) / f"{lab}.ipynb"
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[0]
        text = first.source
        listing = lab_listing(lab, labs[lab], counts, tests_dir)
        new = _with_listing(text, listing, f"{path}'s first cell") if BEGIN_LISTING in text \
            else f"{text.rstrip()}\n\n{listing}"
        if new != text:
            changed.append(str(path))
            if write:
                first.source = new
                nbformat.write(nb, path)
    if readme is not None:
        text = Path(readme).read_text()
        new = _with_listing(text, readme_listing(labs, counts, tests_dir), str(readme))
        if new != text:
            changed.append(str(readme))
            if write:
                Path(readme).write_text(new)
    return changed


def problems(solutions: Path, tests_dir: Path = TESTS) -> list[str]:
    """Where the exercise tests, ``solutions/`` and :data:`ANSWERS` disagree (empty: none)."""
    import nbformat

    from distlab.grading import notebook

    found = []
    labs = exercises(tests_dir)
    books = {p.stem: p for p in sorted(Path(solutions).glob("*.ipynb"))}
    for lab in sorted(set(books) | set(labs)):
        if lab not in books:
            found.append(f"tests declare NOTEBOOK = {lab!r}, but solutions/ has no {lab}.ipynb")
            continue
        names = set(notebook.exercises(nbformat.read(books[lab], as_version=4)))
        graded = set(labs.get(lab, ()))
        for name in sorted(names - graded):
            found.append(f"{lab}: solutions/ has the exercise {name}, but no test file of the "
                         f"kit declares it (test_{name}.py with NOTEBOOK = {lab!r}): it would "
                         f"not be graded")
        for name in sorted(graded - names):
            found.append(f"{lab}: test_{name}.py declares NOTEBOOK = {lab!r}, but "
                         f"solutions/{lab}.ipynb has no exercise cell {name}")
    for lab, names in labs.items():
        for name in names:
            if name not in ANSWERS:
                found.append(f"{name} ({lab}) has no entry in distlab.grading.answers.ANSWERS: "
                             f"name the library code that answers it, or () for none")
    for refs in ANSWERS.values():
        for ref in refs:
            module, name = ref.split(":")
            if not hasattr(importlib.import_module(module), name):
                found.append(f"ANSWERS names {ref}, which does not exist")
    return found


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m distlab.grading.labs")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="exit 1 where the exercise tests, solutions/ and ANSWERS "
                                 "disagree").add_argument("solutions", type=Path)
    p = sub.add_parser("render", help="write the graded exercises and their points into each "
                                      "solution notebook's first cell and the README")
    p.add_argument("solutions", type=Path)
    p.add_argument("--readme", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "render":
        for path in render(args.solutions, args.readme):
            print(f"wrote the graded exercises into {path}")
        return 0
    found = problems(args.solutions)
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print("distlab.grading.labs agrees with solutions/ and the exercise tests")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
