"""Exercise cells in the nbgrader convention, and the student release of a notebook.

An exercise cell carries ``{"nbgrader": {"solution": true, "grade_id": NAME}}`` in
its metadata, NAME being the function or class it defines, and its answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION``. The release replaces each answer with
``raise NotImplementedError`` (as nbgrader's ``ClearSolutions``) and drops outputs.

The release stamps each lab with a fingerprint of its cells (metadata ``distlab.release``,
:func:`fingerprint`: cell types and sources, so that opening or running a lab changes
nothing it counts). ``release`` refuses to overwrite a lab whose cells differ both from
its stamp and from the new release (a student's work); ``--force`` first keeps a copy of
each such lab in ``labs/backup/`` (:func:`release_dir`).

    python -m distlab.grading.notebook release solutions labs   # make labs (--force: FORCE=1)
    python -m distlab.grading.notebook check solutions labs     # exit 1 when labs/ is stale
    python -m distlab.grading.notebook execute solutions/00_setup.ipynb  # rerun, keep outputs
"""
from __future__ import annotations

import ast
import copy
import errno
import hashlib
import itertools
import json
import os
import re
import stat
import sys
import time
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


class Unreadable(ValueError):
    """What :func:`read_plain` refused: ``why`` is "link", "missing", "unopenable",
    "not regular", "other names" or "too large"; ``detail`` the system's words."""

    def __init__(self, why: str, detail: str = ""):
        super().__init__(why)
        self.why, self.detail = why, detail


def read_plain(name, limit: int, dir_fd: int | None = None) -> bytes:
    """The bytes of file ``name`` (in the folder ``dir_fd`` if given), read by a grader
    that may be root: the file itself (a link is refused, O_NOFOLLOW), a regular file with
    no other name (no hard link), at most ``limit`` bytes. :class:`Unreadable` otherwise."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        raise Unreadable({errno.ELOOP: "link", errno.ENOENT: "missing"}.get(
            exc.errno, "unopenable"), exc.strerror or "") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not regular")
        if st.st_nlink > 1:
            raise Unreadable("other names")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Unreadable("too large")
    return data


def read_submission(path: Path, max_mb: float = MAX_NOTEBOOK_MB):
    """The notebook at ``path``, read by :func:`read_plain` (no link, no hard link, at
    most ``max_mb`` MiB), checked before anything is parsed. :class:`SubmissionError`
    otherwise; its message never quotes the file's content."""
    try:
        data = read_plain(path, int(max_mb * 2**20))
    except Unreadable as exc:
        raise SubmissionError(f"{path} " + {
            "link": "is a symbolic link: submit the notebook file itself",
            "missing": "does not exist",
            "unopenable": f"cannot be opened ({exc.detail})",
            "not regular": "is not a regular file: submit the notebook file",
            "other names": "has other names (hard links): submit a copy of the notebook",
            "too large": f"is larger than {max_mb:g} MiB, more than a lab notebook can be: "
                         f"clear its outputs (Edit > Clear Outputs of All Cells), save, and "
                         f"submit it again"}[exc.why]) from None
    try:
        return parse(data)
    except (ValueError, RecursionError) as exc:  # bad UTF-8, JSON, notebook: said, not quoted
        raise SubmissionError(
            f"{path} is not a readable notebook ({type(exc).__name__}); open it in "
            f"JupyterLab and save it again, or restore it from git") from None


class Node(dict):
    """A notebook's JSON object whose keys read as attributes, as nbformat's NotebookNode."""

    def __getattr__(self, key: str):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value) -> None:
        self[key] = value


def parse(data: bytes) -> Node:
    """The nbformat-4 notebook in ``data``, with each cell's source one string; ValueError
    when it is not one (a cell without a known type or a text source, metadata that is not
    an object). Read without nbformat, whose schema checker's import alone costs about a
    CPU-second, a grading's largest fixed cost after torch's."""
    nb = json.loads(data.decode("utf-8"), object_hook=Node)
    if (not isinstance(nb, Node) or nb.get("nbformat") != 4
            or not isinstance(nb.get("cells"), list)):
        raise ValueError("not an nbformat 4 notebook")
    for cell in (nb, *nb.cells):
        if not isinstance(cell, Node) or not isinstance(cell.setdefault("metadata", Node()), Node):
            raise ValueError("a cell or metadata that is not an object")
    for cell in nb.cells:
        source = cell.get("source")
        if isinstance(source, list) and all(isinstance(line, str) for line in source):
            cell.source = "".join(source)
        if (cell.get("cell_type") not in ("code", "markdown", "raw")
                or not isinstance(cell.get("source"), str)):
            raise ValueError("a cell without a known type or a text source")
    return nb


def grade_id(cell) -> str | None:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    if not isinstance(meta, dict) or not meta.get("solution"):
        return None
    name = meta.get("grade_id")
    return name if isinstance(name, str) else None


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


def fingerprint(nb) -> str:
    """sha256 of the notebook's cells' types and sources: what a student edits (a cell's
    code or text, a cell added or removed), not what opening or running it changes
    (outputs, execution counts, metadata)."""
    cells = [[cell.cell_type, cell.source] for cell in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def stamp(nb) -> str | None:
    """The fingerprint the release stamped a lab with (None: an unstamped lab)."""
    meta = nb.metadata.get("distlab")
    found = meta.get("release") if isinstance(meta, dict) else None
    return found if isinstance(found, str) else None


def release(nb):
    """A copy of solution notebook ``nb`` for students: answers stubbed, no outputs, no
    record of the solution's run (execution counts, the kernel's timestamps), stamped
    with its :func:`fingerprint`."""
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if cell.cell_type != "code":
            continue
        if grade_id(cell):
            cell.source = clear_solutions(cell.source)
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
    out.metadata.pop("widgets", None)  # the state of the solution's widgets, now outputless
    out.metadata["distlab"] = {"release": fingerprint(out)}
    return out


def is_test_cell(cell) -> bool:
    """An nbgrader test cell (graded, no solution), such as the autograder cell that
    :mod:`distlab.grading.course` adds after each exercise: the kit's code, not the
    student's."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return isinstance(meta, dict) and bool(meta.get("grade")) and not meta.get("solution")


def imports(nb) -> list[str]:
    """The top-level import statements of every code cell but nbgrader's test cells (the
    prelude of an exercise module, so that exercise cells may use what the notebook
    imported; the autograder cell's import of the grader would cost every graded rank
    seconds)."""
    found: dict[str, None] = {}  # in order, each once: linear in the notebook's size
    for cell in nb.cells:
        if cell.cell_type != "code" or is_test_cell(cell):
            continue
        try:
            tree = ast.parse(_strip_magics(cell.source))
        except UNPARSABLE:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.setdefault(ast.unparse(node))
    return list(found)


def _strip_magics(source: str) -> str:
    """``source`` with IPython's magic and shell lines blanked, not removed: every other
    line keeps its number (lines cut at line feeds only, as Python counts them)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.split("\n"))


def compile_problem(name: str, source: str) -> str:
    """"" when exercise cell ``name`` compiles; else what stops it, in the student's terms:
    "line 3, column 12 of your NAME cell: <Python's words>", then that line with a caret
    under the column (lines and columns as the cell shows them)."""
    try:
        compile(_strip_magics(source), f"<your {name} cell>", "exec")
    except SyntaxError as exc:
        return _syntax_message(name, source, exc)
    except ValueError as exc:
        return f"your {name} cell cannot be compiled: {exc}"
    except UNPARSABLE as exc:  # the parser's own stack or memory ran out
        return (f"your {name} cell is nested too deeply for Python to compile it "
                f"({type(exc).__name__}): split its longest expression into smaller "
                f"statements")
    return ""


def _syntax_message(name: str, source: str, exc: SyntaxError) -> str:
    from distlab.grading.output import shown

    lines = source.split("\n")
    if not exc.lineno or not 0 < exc.lineno <= len(lines):
        return f"your {name} cell: {exc.msg}"
    column = exc.offset if exc.offset and exc.offset > 0 else 0
    head = (f"line {exc.lineno}" + (f", column {column}" if column else "") +
            f" of your {name} cell: {exc.msg}")
    line = lines[exc.lineno - 1].rstrip()
    before = line[:max(column - 1, 0)].expandtabs(8)
    line = line.expandtabs(8)
    indent = len(line) - len(line.lstrip())
    start = max(indent, len(before) - 60)  # a long line: up to 60 characters before the column
    cut = "..." if start > indent else ""
    text = cut + line[start:start + 80] + ("..." if len(line) > start + 80 else "")
    if not column:
        return f"{head}\n    {text}"
    caret = len(shown(cut + before[start:]))  # under the column as the grader prints the line
    return f"{head}\n    {text}\n    {' ' * caret}^"


def module_source(nb, prelude: list[str] | None = None,
                  problems: dict[str, str] | None = None) -> str:
    """A Python module made of the notebook's exercise cells (after its imports).

    A cell that does not compile (:func:`compile_problem`) becomes a stub raising a
    SyntaxError that says so when called, so that an exercise calling it is told why;
    the grader reports the cell itself, without running its tests. ``prelude`` and
    ``problems``: :func:`imports` and :func:`compile_problem`'s answers where the caller
    has them already (a notebook is parsed once)."""
    parts = ['"""Exercises extracted from a notebook by distlab.grading.notebook."""']
    parts += imports(nb) if prelude is None else prelude
    for name, source in exercises(nb).items():
        problem = (problems or {}).get(name)
        if problem is None:
            problem = compile_problem(name, source)
        source = (f"def {name}(*args, **kwargs):\n    raise SyntaxError("
                  f"{f'{name} does not compile ({problem.splitlines()[0]})'!r})"
                  if problem else _strip_magics(source))
        parts.append(f"# --- exercise {name}\n{source}")
    return "\n\n".join(parts) + "\n"


BACKUP = "backup"  # the folder of labs/ where a forced release keeps the labs it overwrites


class EditedLabs(RuntimeError):
    """The release would overwrite labs someone edited (``paths``); nothing was written."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        super().__init__(
            "these labs were edited since the release wrote them, and writing the new "
            "release would lose that work:\n" + "".join(f"  {p}\n" for p in paths) +
            f"Nothing was written. `make labs FORCE=1` (--force) keeps a copy of each in "
            f"{paths[0].parent / BACKUP}/, then writes the new release.")


def _edited(path: Path, new) -> bool:
    """Whether the lab at ``path`` holds work that writing ``new`` over it would lose: its
    cells differ from its stamp and from ``new``'s (an unstamped lab: from ``new``'s). A
    file that is not a readable notebook counts as edited."""
    import nbformat

    if not path.exists():
        return False
    try:
        nb = nbformat.read(path, as_version=4)
        return fingerprint(nb) not in (stamp(nb), fingerprint(new))
    except Exception:  # noqa: BLE001 — whatever the file holds is someone's
        return True


def _keep_copy(path: Path) -> Path:
    """A copy of the lab at ``path`` in ``labs/backup/``, ``NAME-<date>-<time>.ipynb``
    (a file the grader still takes for that lab's), never written over another copy."""
    folder = path.parent / BACKUP
    folder.mkdir(exist_ok=True)
    data = path.read_bytes()
    when = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        kept = folder / f"{path.stem}-{when}{f'-{n}' if n > 1 else ''}.ipynb"
        try:
            fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return kept


def release_dir(solutions: Path, labs: Path, force: bool = False) -> tuple[list[Path], dict]:
    """Write the release of each solution notebook into ``labs``, each file replaced whole
    (:func:`distlab.grading.output.replace_file`); returns (the labs written, {lab: the
    copy kept of it}). A lab someone edited (:func:`_edited`) is never lost: without
    ``force`` :class:`EditedLabs` is raised before anything is written; with it, a copy of
    each such lab is kept in ``labs/backup/`` (:func:`_keep_copy`) before any is written."""
    import nbformat

    from distlab.grading.output import replace_file

    plan = [(labs / src.name, release(nbformat.read(src, as_version=4)))
            for src in sorted(solutions.glob("*.ipynb"))]
    edited = [dst for dst, nb in plan if _edited(dst, nb)]
    if edited and not force:
        raise EditedLabs(edited)
    labs.mkdir(parents=True, exist_ok=True)
    kept = {dst: _keep_copy(dst) for dst in edited}
    for dst, nb in plan:
        replace_file(dst, (nbformat.writes(nb).rstrip("\n") + "\n").encode())
    return [dst for dst, _ in plan], kept


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
    # no widget state: a stored widget shows its own fallback (a picture, a snapshot that
    # says to run the cell), never state that a fresh JupyterLab does not draw
    NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=False,
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
        if name == "release":
            p.add_argument("--force", action="store_true",
                           help="overwrite edited labs too, keeping a copy of each in "
                                f"LABS/{BACKUP}/")
    p = sub.add_parser("execute")
    p.add_argument("notebooks", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "execute":
        for path in args.notebooks:
            execute(path)
            print(f"executed {path}")
        return 0
    if args.command == "release":
        try:
            written, kept = release_dir(args.solutions, args.labs, args.force)
        except EditedLabs as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}")
        for path, copy_path in kept.items():
            print(f"your edited {path.name} is kept as {copy_path} (in JupyterLab: the "
                  f"{BACKUP} folder)")
        return 0
    bad = stale(args.solutions, args.labs)
    if bad:
        print(f"labs/ is out of date for {', '.join(bad)}: run `make labs`", file=sys.stderr)
        return 1
    print("labs/ matches solutions/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
