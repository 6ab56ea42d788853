"""Exercise cells in the nbgrader convention, and the student release of a notebook.

An exercise cell carries ``{"nbgrader": {"solution": true, "grade_id": NAME}}`` in
its metadata, NAME being the function or class it defines, and its answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION``. The release replaces each answer with
``raise NotImplementedError`` (as nbgrader's ``ClearSolutions``) and drops outputs.

    python -m distlab.grading.notebook release solutions labs   # make labs
    python -m distlab.grading.notebook check solutions labs     # exit 1 when labs/ is stale
    python -m distlab.grading.notebook execute solutions/00_setup.ipynb  # rerun, keep outputs
"""
from __future__ import annotations

import ast
import copy
import errno
import os
import re
import stat
import sys
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = "raise NotImplementedError"
_REGION = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[^\n]*\n.*?^[ \t]*{re.escape(END)}[^\n]*$",
                     re.MULTILINE | re.DOTALL)


# what parsing or compiling a cell can raise: deep nesting overflows the parser's stack
UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)
MAX_NOTEBOOK_MB = 64  # a submission larger than this is refused before it is parsed


class SubmissionError(ValueError):
    """A submitted notebook the grader refuses to read; the message names the fix."""


def read_submission(path: Path, max_mb: float = MAX_NOTEBOOK_MB):
    """The notebook at ``path``, read by a grader that may be root: the file itself (a
    link is refused, O_NOFOLLOW), a regular file with no other name (no hard link), at
    most ``max_mb`` MiB, checked before anything is parsed. :class:`SubmissionError`
    otherwise; its message never quotes the file's content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SubmissionError(f"{path} is a symbolic link: submit the notebook file "
                                  f"itself") from None
        if exc.errno == errno.ENOENT:
            raise SubmissionError(f"{path} does not exist") from None
        raise SubmissionError(f"{path} cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SubmissionError(f"{path} is not a regular file: submit the notebook file")
        if st.st_nlink > 1:
            raise SubmissionError(f"{path} has other names (hard links): submit a copy of "
                                  f"the notebook")
        limit = int(max_mb * 2**20)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise SubmissionError(f"{path} is larger than {max_mb:g} MiB, more than a lab "
                              f"notebook can be: clear its outputs (Edit > Clear Outputs "
                              f"of All Cells), save, and submit it again")
    import nbformat  # here, not at the top: the grader's pytest, which imports this module's
    #                  helpers, never reads a notebook (nbformat's schema checks cost ~1.3 s)

    try:
        return nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as exc:  # noqa: BLE001 — invalid UTF-8, JSON, notebook: said, not quoted
        raise SubmissionError(
            f"{path} is not a readable notebook ({type(exc).__name__}); open it in "
            f"JupyterLab and save it again, or restore it from git") from None


def grade_id(cell) -> str | None:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta.get("grade_id") if meta.get("solution") else None


def exercises(nb) -> dict[str, str]:
    """NAME → source of each exercise cell, in notebook order."""
    return {grade_id(c): c.source for c in nb.cells if c.cell_type == "code" and grade_id(c)}


def clear_solutions(source: str) -> str:
    """The student's version of an exercise cell: each answer becomes a stub."""
    return _REGION.sub(lambda m: f"{m.group(1)}{STUB}", source)


def is_untouched(source: str) -> bool:
    """True when every answer region of a released cell is still the bare stub."""
    body = [line.strip() for line in source.splitlines()]
    return STUB in body and BEGIN not in source


def release(nb):
    """A copy of solution notebook ``nb`` for students: answers stubbed, no outputs, no
    record of the solution's run (execution counts, the kernel's timestamps)."""
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if cell.cell_type != "code":
            continue
        if grade_id(cell):
            cell.source = clear_solutions(cell.source)
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
    return out


def imports(nb) -> list[str]:
    """The top-level import statements of every code cell (the prelude of an exercise
    module, so that exercise cells may use what the notebook imported)."""
    found: list[str] = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(_strip_magics(cell.source))
        except UNPARSABLE:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                line = ast.unparse(node)
                if line not in found:
                    found.append(line)
    return found


def _strip_magics(source: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def module_source(nb) -> str:
    """A Python module made of the notebook's exercise cells (after its imports).

    A cell that does not compile becomes a stub raising its SyntaxError when called, so
    one broken cell does not sink the other exercises."""
    parts = ['"""Exercises extracted from a notebook by distlab.grading.notebook."""']
    parts += imports(nb)
    for name, source in exercises(nb).items():
        source = _strip_magics(source)
        try:
            compile(source, f"<exercise {name}>", "exec")
        except UNPARSABLE as exc:  # nested too deep to compile, too: the same stub
            why = str(exc) if isinstance(exc, SyntaxError) else (
                f"{type(exc).__name__} (nested too deeply)")
            source = (f"def {name}(*args, **kwargs):\n    raise SyntaxError("
                      f"{f'the cell of {name} does not compile: {why}'!r})")
        parts.append(f"# --- exercise {name}\n{source}")
    return "\n\n".join(parts) + "\n"


def release_dir(solutions: Path, labs: Path) -> list[Path]:
    import nbformat

    labs.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(solutions.glob("*.ipynb")):
        dst = labs / src.name
        nbformat.write(release(nbformat.read(src, as_version=4)), dst)
        written.append(dst)
    return written


def stale(solutions: Path, labs: Path) -> list[str]:
    """Names of labs that differ from the release of their solution, or are missing,
    or have no solution."""
    import nbformat

    bad = []
    for src in sorted(solutions.glob("*.ipynb")):
        dst = labs / src.name
        want = nbformat.writes(release(nbformat.read(src, as_version=4)))
        if not dst.exists() or nbformat.writes(nbformat.read(dst, as_version=4)) != want:
            bad.append(src.name)
    extra = {p.name for p in labs.glob("*.ipynb")} - {p.name for p in solutions.glob("*.ipynb")}
    return bad + sorted(extra)


def execute(path: Path, timeout: float = 900) -> None:
    """Run a notebook top to bottom in a fresh kernel and store its outputs in place
    (how solutions/ gets its outputs; nbval then checks they are reproduced)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m distlab.grading.notebook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("release", "check"):
        p = sub.add_parser(name)
        p.add_argument("solutions", type=Path)
        p.add_argument("labs", type=Path)
    p = sub.add_parser("execute")
    p.add_argument("notebooks", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "execute":
        for path in args.notebooks:
            execute(path)
            print(f"executed {path}")
        return 0
    if args.command == "release":
        for path in release_dir(args.solutions, args.labs):
            print(f"wrote {path}")
        return 0
    bad = stale(args.solutions, args.labs)
    if bad:
        print(f"labs/ is out of date for {', '.join(bad)}: run `make labs`", file=sys.stderr)
        return 1
    print("labs/ matches solutions/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
