"""``python -m distlab.grading NOTEBOOK|FOLDER... [--lab N] [--json FILE]``: the grader's
command line. It grades each notebook with :func:`distlab.grading.runner.grade`, prints
the table and writes the JSON report whole or not at all; a usage error (a lab that is
none, a folder with no notebook of it, a bad hidden test) exits 2 and writes no report."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import sys
from pathlib import Path

from distlab.grading import labs, notebook, runner
from distlab.grading.hidden import HiddenTests, hidden_tests
from distlab.grading.output import shown, table, traffic_evidence, write_report
from distlab.runtime import privileges


USAGE = """python -m distlab.grading grades lab notebooks: it runs the kit's tests of each
exercise against your answers and prints, per exercise, its points, its verdict and the
first check that failed.

  make grade              grade every notebook in labs/ (and write grade-report.json)
  make grade LAB=03       grade one lab (LAB=3, 03 or 03_ring_allreduce)

  python -m distlab.grading labs/03_ring_allreduce.ipynb --json report.json

It takes notebooks, or folders of them (a folder: its *.ipynb)."""


def lab_named(text: str, every: dict) -> str:
    """The lab ``--lab`` names: a lab's name or its number (``3``, ``03``); a ValueError
    listing the labs (and the likeliest, where one is close) otherwise. ``every``:
    :func:`distlab.grading.labs.exercises`'s answer."""
    if text in every:
        return text
    numbered = {int(m[0]): lab for lab in every for m in [re.match(r"\d+", lab)] if m}
    if text.isascii() and text.isdigit() and int(text) in numbered:
        return numbered[int(text)]
    close = [lab for lab in every if text and text.lower() in lab.lower()] or \
        difflib.get_close_matches(text, list(every), 1)
    raise ValueError(f"--lab {text} is not a lab" + (
        f": did you mean {close[0]}?" if close else ".") + f" The labs: {', '.join(every)} "
        f"(give a name, or a number: 3, 03 or 03_ring_allreduce)")


def _notebooks(paths: list[Path]) -> list[Path]:
    """``paths`` with each folder replaced by its notebooks (``*.ipynb``, sorted; hidden
    files left out, as the shell's ``*`` does)."""
    found = []
    for path in paths:
        found += sorted(p for p in path.glob("*.ipynb") if not p.name.startswith(".")) \
            if path.is_dir() else [path]
    return found


def _selected(given: list[Path], lab: str | None, only: list[str]) -> list[Path]:
    """The notebooks to grade: ``given``'s (:func:`_notebooks`), those of lab ``lab``
    (:func:`lab_named`) where it is not None. A ValueError, naming the fix, where that
    leaves none or ``only`` names an exercise of none of their labs."""
    every = labs.exercises()
    paths = _notebooks(given)
    where = ", ".join(map(str, given))
    if not paths:
        raise ValueError(f"no notebook (*.ipynb) in {where}")
    if lab is not None:
        lab = lab_named(lab, every)
        paths = [path for path in paths if labs.lab_of(path, every) == lab]
        if not paths:
            raise ValueError(f"no notebook of {lab} in {where} (its notebook is {lab}.ipynb). "
                             f"The labs: {', '.join(every)}")
    graded = [every[name] for name in dict.fromkeys(labs.lab_of(p, every) for p in paths) if name]
    offered = [name for names in graded for name in names]
    unknown = [name for name in only if name not in offered]
    if graded and unknown:
        raise ValueError(f"--exercise {', '.join(unknown)}: no such exercise in the labs "
                         f"graded; their exercises: {', '.join(offered)}")
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m distlab.grading``; a usage error (exit 2) writes no report."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(f"{USAGE}\n`python -m distlab.grading --help` lists its options.", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m distlab.grading", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path,
                        help="notebooks, or folders whose notebooks are graded")
    parser.add_argument("--lab", help="grade only the notebooks of this lab (3, 03 or "
                                      "03_ring_allreduce)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=runner.EXERCISE_TIMEOUT,
                        help="seconds for the tests of one exercise (default %(default)s)")
    parser.add_argument("--notebook-timeout", type=float, default=runner.NOTEBOOK_TIMEOUT,
                        help="seconds for all the exercises of one notebook (default "
                             "%(default)s); those left count as timed out")
    parser.add_argument("--exercise", action="append", help="grade only this exercise")
    parser.add_argument("--memory", type=int, default=None,
                        help="MiB of data each graded rank may allocate (default: an eighth of "
                             "this machine's memory, at least 2048)")
    parser.add_argument("--hidden-tests", type=Path, metavar="DIR",
                        help="an instructor's own test files (test_<exercise>.py, "
                             "test_<exercise>_*.py, declaring NOTEBOOK) run with the kit's")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    with contextlib.ExitStack() as stack:
        try:
            paths = _selected(args.notebooks, args.lab, args.exercise or [])
            hidden = stack.enter_context(hidden_tests(
                args.hidden_tests, {labs.lab_of(p) for p in paths} - {None})
            ) if args.hidden_tests else None
        except ValueError as exc:
            print(f"{parser.prog}: error: {shown(exc)}", file=sys.stderr)
            return 2
        return _grade_all(args, paths, hidden)


def _grade_all(args, paths: list[Path], hidden: HiddenTests | None) -> int:
    """Grade ``paths`` as :func:`main` was asked; its exit status."""
    privileges.make_non_dumpable()
    user, why = privileges.unprivileged_user()
    if not user and os.geteuid() == 0:
        print(f"warning: students' code will run as root: {why}", file=sys.stderr)
    report, unreadable = {}, 0
    for path in paths:
        results = None
        try:
            notebook.read_submission(path)  # unreadable before unknown, as the user fixes them
            if labs.lab_of(path) is None:
                problem = labs.unknown_lab_message(path)
            else:
                results = runner.grade(path, timeout=args.timeout, only=args.exercise,
                                memory_mb=args.memory, total=args.notebook_timeout,
                                hidden=hidden)
        except notebook.SubmissionError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 — one notebook never stops the batch
            problem = (f"grading this notebook failed ({type(exc).__name__}: "
                       f"{str(exc)[:300]}); the others were graded")
        if results is None:
            print(f"\n{shown(path)}\nerror: {shown(problem)}", flush=True)
            report[str(path)] = {"error": problem}
            unreadable += 1
            continue
        print(table(results, title=f"\n{path}"), flush=True)
        report[str(path)] = {r.exercise: {"points": r.points, "max": r.max_points,
                                          "verdict": r.verdict, "message": r.message,
                                          "blocked": r.blocked, "hint": r.hint,
                                          "self_reported": r.self_reported,
                                          "traffic": traffic_evidence()} for r in results}
    if args.json:
        try:
            write_report(args.json, json.dumps(report, indent=2))  # whole or not at all
        except OSError as exc:
            print(f"\nerror: {shown(exc)}", file=sys.stderr)
            return 2
        print(f"\nwrote {shown(args.json)}")
    return 1 if unreadable else 0
