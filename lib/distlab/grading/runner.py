"""The autograder: extract a notebook's exercises, run their tests, report.

    python -m distlab.grading labs/03_ring_allreduce.ipynb [--json report.json]

Each exercise of the notebook is tested by ``exercises/test_<name>.py`` (beside this
module, so installed with the package) in a ``pytest`` process with a time limit, against a module made of the notebook's
exercise cells. Every test is worth one point. Tiers: cpu (gloo, always), gpu,
multigpu; tests of a tier this machine cannot run are "blocked", not failed.

Isolation: exercises never share a process; within one exercise's tests the ranks stay
warm between launches (the launcher throws them away after any failure), which keeps
a whole lab's grading within seconds per exercise. What the grader guarantees against
students' code, and what it does not, is in :mod:`distlab.grading.sandbox`: the student's code
runs only in sandboxed ranks (as an unprivileged user where the grader is root), the
tests check plain data in a process that never imports it, the outcomes travel through
a pipe, and every process of an exercise's run is killed before its grade is read.

The pytest process loads :mod:`distlab.grading.plugin`, which streams each test's
outcome and its first failing check in plain words back through a pipe.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from distlab.grading.plugin import EXERCISE_TIMEOUT

TESTS = Path(__file__).resolve().parent / "exercises"  # installed with the package


@dataclasses.dataclass
class Result:
    exercise: str
    points: int
    max_points: int
    verdict: str   # pass, partial, fail, deadlock, not attempted, error, timeout, blocked
    message: str   # the first failing check, in plain words
    blocked: int = 0  # tests this machine could not run
    seconds: float = 0.0


def _summarise(name: str, tests: list[dict], seconds: float) -> Result:
    ran = [t for t in tests if t["outcome"] not in ("blocked", "skipped")]
    blocked = [t for t in tests if t["outcome"] == "blocked"]
    passed = [t for t in ran if t["outcome"] == "passed"]
    failed = [t for t in ran if t["outcome"] != "passed"]
    if not tests:
        return Result(name, 0, 0, "error", "no tests were collected for this exercise",
                      seconds=seconds)
    if not ran:
        return Result(name, 0, 0, "blocked", blocked[0]["message"], len(blocked), seconds)
    if not failed:
        verdict, message = "pass", ""
    else:
        kinds = {t["outcome"] for t in failed}
        first = failed[0]
        verdict = ("not attempted" if kinds == {"not attempted"} and not passed else
                   "deadlock" if "deadlock" in kinds else
                   "timeout" if "timeout" in kinds and not passed else
                   "partial" if passed else "fail")
        message = next((t for t in failed if t["outcome"] == "deadlock"), first)["message"]
        message = f"{first['test'].split('::')[-1]}: {message}" if verdict != "not attempted" \
            else message
    return Result(name, len(passed), len(ran), verdict, message, len(blocked), seconds)


PLUGIN = "distlab.grading.plugin"


def _pytest(report_fd: int, tests_dir: Path, *args: str) -> list[str]:
    """A pytest command line whose outcomes the grader's plugin streams to ``report_fd``."""
    return [sys.executable, "-m", "pytest", "-q", "-p", PLUGIN, "-p", "no:cacheprovider",
            f"--distlab-report-fd={report_fd}", f"--rootdir={tests_dir}", *args]


def _run_reported(args: list[str], env: dict, timeout: float,
                  tests_dir: Path) -> tuple[int | None, str, list[dict]]:
    """Run pytest with ``args`` under :func:`distlab.grading.sandbox.run_contained`; (exit status or
    None on timeout, output, the records it streamed)."""
    from distlab.grading import sandbox

    read, write = os.pipe()
    stream: list[bytes] = []
    reader = threading.Thread(target=lambda: stream.extend(iter(
        lambda: os.read(read, 1 << 16), b"")), daemon=True)
    reader.start()
    try:
        code, out = sandbox.run_contained(_pytest(write, tests_dir, *args), env=env, cwd=tests_dir,
                                          timeout=timeout, pass_fds=[write])
    finally:
        os.close(write)
        reader.join(10)
        os.close(read)
    records = []
    for line in b"".join(stream).decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return code, out, records


def grade(path: Path, tests_dir: Path = TESTS, timeout: float = EXERCISE_TIMEOUT,
          only: list[str] | None = None) -> list[Result]:
    """Grade every exercise of the notebook at ``path``: one contained pytest run over the
    exercises' test files, each exercise's tests limited to ``timeout`` seconds."""
    import nbformat

    from distlab.grading import notebook
    from distlab.runtime import privileges

    nb = nbformat.read(path, as_version=4)
    cells = {name: source for name, source in notebook.exercises(nb).items()
             if not only or name in only}
    files = {name: tests_dir / f"test_{name}.py" for name in cells}
    missing = {name for name, f in files.items() if not f.exists()}
    untouched = {name for name, source in cells.items() if notebook.is_untouched(source)}
    user, _ = privileges.unprivileged_user()
    with tempfile.TemporaryDirectory(prefix="distlab-grade-") as tmp:
        os.chmod(tmp, 0o755)  # readable by the user the student's code runs as
        module = Path(tmp) / f"student_{path.stem}.py"
        module.write_text(notebook.module_source(nb))
        module.chmod(0o644)
        runs = Path(tmp) / "tmp"
        runs.mkdir(mode=0o711)  # the ranks' own folders go here, and go with it
        env = dict(os.environ, DISTLAB_STUDENT=str(module), DISTLAB_SANDBOX="1",
                   DISTLAB_SANDBOX_USER=user, TMPDIR=str(runs))
        attempted = len(set(cells) - untouched - missing)
        start = time.monotonic()
        code, out, records = (None, "", []) if len(missing) == len(cells) else _run_reported(
            [f"--distlab-untouched={','.join(sorted(untouched))}",
             f"--distlab-exercise-timeout={timeout}",
             *(str(f) for name, f in files.items() if name not in missing)],
            env, timeout * attempted + 120, tests_dir)
        seconds = time.monotonic() - start
    collected = next((r["collected"] for r in records if "collected" in r), [])
    outcomes = {r["test"]: r for r in records if "outcome" in r}
    ended = any(r.get("end") for r in records)
    broke = ("the tests did not finish within their time limit" if code is None else
             f"the test run ended before this test (exit status {code}): "
             f"{' | '.join(out.strip().splitlines()[-2:])}")
    results = []
    for name in cells:
        mine = [c for c in collected if c.get("exercise") == name]
        runnable = sum(not c["blocked"] for c in mine)
        if name in missing:
            results.append(Result(name, 0, 0, "error", f"no tests for this exercise "
                                                        f"({files[name]} missing)"))
        elif name in untouched:
            results.append(Result(name, 0, runnable, "not attempted",
                                  "the cell still raises NotImplementedError", len(mine) - runnable))
        elif not mine:
            results.append(Result(name, 0, 0, "error", "its tests could not be collected: " +
                                  " | ".join(out.strip().splitlines()[-3:])))
        else:
            tests = [outcomes.get(c["test"]) or (
                {"test": c["test"], "outcome": "blocked", "message": c["blocked"]} if c["blocked"]
                else {"test": c["test"], "outcome": "timeout" if code is None else "error",
                      "message": broke if not ended else "the test reported no outcome"})
                     for c in mine]
            results.append(_summarise(name, tests, seconds / max(attempted, 1)))
    return results


def table(results: list[Result], title: str = "") -> str:
    rows = [("exercise", "points", "verdict", "first failing check")]
    for r in results:
        pts = f"{r.points}/{r.max_points}" + (f" (+{r.blocked} blocked)" if r.blocked else "")
        rows.append((r.exercise, pts, r.verdict, r.message))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [title] if title else []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    total = sum(r.points for r in results), sum(r.max_points for r in results)
    lines.append(f"total: {total[0]}/{total[1]}")
    return "\n".join(lines)


def _readable_notebook(path: Path) -> str:
    """Why ``path`` cannot be graded ("" when it can)."""
    import nbformat

    if not path.is_file():
        return f"{path} does not exist (or is not a file)"
    try:
        nbformat.read(path, as_version=4)
    except Exception as exc:  # invalid JSON, not a notebook, unreadable
        return (f"{path} is not a readable notebook ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); open it in JupyterLab "
                f"and save it again, or restore it from git")
    return ""


def main(argv: list[str] | None = None) -> int:
    import argparse

    from distlab.runtime import privileges

    parser = argparse.ArgumentParser(prog="python -m distlab.grading",
                                     description="Grade lab notebooks.")
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=EXERCISE_TIMEOUT,
                        help="seconds for the tests of one exercise (default %(default)s)")
    parser.add_argument("--exercise", action="append", help="grade only this exercise")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    privileges.make_non_dumpable()
    user, why = privileges.unprivileged_user()
    if not user and os.geteuid() == 0:
        print(f"warning: students' code will run as root: {why}", file=sys.stderr)
    report, unreadable = {}, 0
    for path in args.notebooks:
        problem = _readable_notebook(path)
        if problem:
            print(f"\n{path}\nerror: {problem}", flush=True)
            report[str(path)] = {"error": problem}
            unreadable += 1
            continue
        results = grade(path, timeout=args.timeout, only=args.exercise)
        print(table(results, title=f"\n{path}"), flush=True)
        report[str(path)] = {r.exercise: {"points": r.points, "max": r.max_points,
                                          "verdict": r.verdict, "message": r.message,
                                          "blocked": r.blocked} for r in results}
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, args.json)  # whole or not at all
        print(f"\nwrote {args.json}")
    return 1 if unreadable else 0
