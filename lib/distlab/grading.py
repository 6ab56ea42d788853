"""The autograder: extract a notebook's exercises, run their tests, report.

    python -m distlab.grade labs/03_ring_allreduce.ipynb [--json report.json]

Each exercise of the notebook is tested by ``tests/exercises/test_<name>.py`` in a
fresh ``pytest`` process with a time limit, against a module made of the notebook's
exercise cells. Every test is worth one point. Tiers: cpu (gloo, always), gpu,
multigpu; tests of a tier this machine cannot run are "blocked", not failed.

Isolation: exercises never share a process; within one exercise's tests the ranks stay
warm between launches (the launcher throws them away after any failure), which keeps
a whole lab's grading within seconds per exercise. What the grader guarantees against
students' code, and what it does not, is in :mod:`distlab.sandbox`: the student's code
runs only in sandboxed ranks (as an unprivileged user where the grader is root), the
tests check plain data in a process that never imports it, the outcomes travel through
a pipe, and every process of an exercise's run is killed before its grade is read.

This module is also the pytest plugin (``-p distlab.grading``) that records, for each
test, its outcome and the first failing check in plain words, and it offers
:func:`expect_close`, the comparison whose message tests and notebooks show students.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "exercises"
EXERCISE_TIMEOUT = 300.0  # seconds for all the tests of one exercise


# ------------------------------------------------------------- checks with plain words


# torch.testing.assert_close's default (rtol, atol) per dtype, to count the wrong elements
_TOLERANCES = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
               "float64": (1e-7, 1e-7)}


def expect_close(actual, expected, what: str, rtol: float | None = None,
                 atol: float | None = None) -> None:
    """Assert two tensors match, saying in plain words where and how they differ.

    Tolerances default to torch.testing's for the dtype; integers must match exactly."""
    import torch

    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected "
                             f"{tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype}, expected {expected.dtype}")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        a, e = actual.detach().cpu().flatten(), expected.detach().cpu().flatten()
        if expected.is_floating_point():
            default_rtol, default_atol = _TOLERANCES.get(str(expected.dtype).removeprefix("torch."), (1.3e-6, 1e-5))
            a, e = a.double(), e.double()
            tol_abs = atol if atol is not None else default_atol
            tol_rel = rtol if rtol is not None else default_rtol
            bad = ((a - e).abs() > tol_abs + tol_rel * e.abs()).nonzero().flatten()
        else:  # integers must match exactly (and a double would round those above 2**53)
            bad = (a != e).nonzero().flatten()
        i = int(bad[0]) if len(bad) else 0
        show = (lambda v: f"{v.item():g}") if expected.is_floating_point() else (
            lambda v: str(v.item()))
        raise AssertionError(
            f"{what}: {len(bad)} of {a.numel()} elements are wrong; the first at flat index "
            f"{i} is {show(a[i])} but should be {show(e[i])}") from None


# -------------------------------------------------------------------- the pytest plugin


def blocked_reason(item) -> str | None:
    """Why this machine cannot run a test of tier gpu/multigpu (None when it can)."""
    from distlab import backend

    gpus = backend.gpu_count()
    if item.get_closest_marker("multigpu") and gpus < 2:
        return f"blocked: needs 2 or more GPUs, this machine has {gpus}"
    if item.get_closest_marker("gpu") and gpus < 1:
        return "blocked: needs a GPU, this machine has none"
    return None



def pytest_addoption(parser):
    parser.addoption("--distlab-report-fd", default=None, type=int,
                     help="write per-test outcomes (JSON) to this inherited file descriptor")


def _verdict_of(exc) -> tuple[str, str]:
    """(kind, plain message) for an exception raised by a test."""
    from distlab.launch import LaunchTimeout, RankCrashed, RankError

    if isinstance(exc, LaunchTimeout):
        where = "; ".join(f"rank {r} {w}" for r, w in sorted(exc.where.items()))
        return "deadlock", f"deadlock: no answer within {exc.timeout:g} s ({where})"
    if isinstance(exc, NotImplementedError) or (
            isinstance(exc, RankError) and exc.exc_type == "NotImplementedError"):
        return "not attempted", "not implemented yet (raise NotImplementedError)"
    if isinstance(exc, RankError):
        tb = exc.remote_traceback.strip().splitlines()
        place = next((line.strip() for line in reversed(tb) if line.strip().startswith("File")), "")
        message = str(exc).splitlines()[0]
        return "error", f"{message} ({place})" if place and exc.exc_type != "AssertionError" else message
    if isinstance(exc, RankCrashed):
        first, *rest = str(exc).splitlines()
        hint = rest[0] if rest and rest[0].startswith("An abort") else ""
        return "error", f"{first} {hint}".strip()
    if isinstance(exc, AssertionError):
        return "fail", (str(exc).split("\nassert ")[0].strip() or "a check failed").splitlines()[0]
    return "error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


class _Recorder:
    """Writes each test's outcome and plain-words message, as JSON, to a pipe."""

    def __init__(self, fd: int):
        self.fd, self.tests = fd, []

    def pytest_collection_modifyitems(self, config, items):
        if config.option.collectonly:  # counting, not running: say what would be blocked
            self.tests = [{"test": item.nodeid, "outcome": "blocked" if blocked_reason(item)
                           else "collected", "message": blocked_reason(item) or ""}
                          for item in items]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.excinfo is not None and report.failed:
            report.distlab_verdict = _verdict_of(call.excinfo.value)

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.outcome == "passed":
            return
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            reason = reason.removeprefix("Skipped: ")
            kind = "blocked" if reason.startswith("blocked") else "skipped"
            self.tests.append({"test": report.nodeid, "outcome": kind, "message": reason})
        elif report.passed:
            self.tests.append({"test": report.nodeid, "outcome": "passed", "message": ""})
        else:
            kind, message = getattr(report, "distlab_verdict", ("error", "the test broke"))
            self.tests.append({"test": report.nodeid, "outcome": kind, "message": message})

    def pytest_sessionfinish(self, session):
        from distlab import launch

        launch.shutdown(graceful=False)  # no rank of this run is left when the report goes
        with os.fdopen(self.fd, "w") as f:
            f.write(json.dumps(self.tests))


def pytest_configure(config):
    fd = config.getoption("--distlab-report-fd", default=None)
    if fd is not None:
        from distlab import sandbox

        sandbox.make_non_dumpable()
        config.pluginmanager.register(_Recorder(fd), "distlab-recorder")


# ------------------------------------------------------------------------ the grader


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
                   "partial" if passed else "fail")
        message = next((t for t in failed if t["outcome"] == "deadlock"), first)["message"]
        message = f"{first['test'].split('::')[-1]}: {message}" if verdict != "not attempted" \
            else message
    return Result(name, len(passed), len(ran), verdict, message, len(blocked), seconds)


def _pytest(report_fd: int, *args: str) -> list[str]:
    """A pytest command line whose outcomes this module's plugin writes to ``report_fd``."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "distlab.grading", "-p",
            "no:cacheprovider", f"--distlab-report-fd={report_fd}", f"--rootdir={ROOT}", *args]


def _run_reported(args: list[str], env: dict, timeout: float,
                  contained: bool = True) -> tuple[int | None, str, list | None]:
    """Run pytest with ``args``, contained (:func:`distlab.sandbox.run_contained`) when
    it may run a student's code; (exit status or None on timeout, output, the outcomes
    it reported or None)."""
    from distlab import sandbox

    read, write = os.pipe()
    report: list[bytes] = []
    reader = threading.Thread(target=lambda: report.extend(iter(
        lambda: os.read(read, 1 << 16), b"")), daemon=True)
    reader.start()
    try:
        if contained:
            code, out = sandbox.run_contained(_pytest(write, *args), env=env, cwd=ROOT,
                                              timeout=timeout, pass_fds=[write])
        else:
            done = subprocess.run(_pytest(write, *args), env=env, cwd=ROOT, pass_fds=[write],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            code, out = done.returncode, done.stdout.decode(errors="replace")
    finally:
        os.close(write)
        reader.join(10)
        os.close(read)
    try:
        tests = json.loads(b"".join(report)) if report else None
    except ValueError:
        tests = None
    return code, out, tests if isinstance(tests, list) else None


def grade_exercise(name: str, module_path: Path, tests_dir: Path = TESTS,
                   timeout: float = EXERCISE_TIMEOUT, max_points: int = 0,
                   user: str = "") -> Result:
    """Grade one exercise. ``max_points`` (from :func:`_count_tests`) stands when the run
    breaks before reporting; ``user`` ("uid:gid") is who the student's code runs as."""
    test_file = tests_dir / f"test_{name}.py"
    if not test_file.exists():
        return Result(name, 0, 0, "error", f"no tests for this exercise ({test_file} missing)")
    with tempfile.TemporaryDirectory(prefix="distlab-grade-") as tmp:
        os.chmod(tmp, 0o711)  # the sandbox user may enter its own folders below, not list
        env = dict(os.environ, DISTLAB_STUDENT=str(module_path), DISTLAB_SANDBOX="1",
                   DISTLAB_SANDBOX_USER=user, TMPDIR=tmp)
        start = time.monotonic()
        code, out, tests = _run_reported([str(test_file)], env, timeout)
        seconds = time.monotonic() - start
    if code is None:
        return Result(name, 0, max_points, "timeout",
                      f"the tests did not finish within {timeout:g} s (a deadlock the tests "
                      f"did not catch, or far too slow)", seconds=seconds)
    if tests is None:
        tail = " | ".join(out.strip().splitlines()[-3:])
        return Result(name, 0, max_points, "error",
                      f"the test run ended before reporting (exit status {code}): {tail}",
                      seconds=seconds)
    return _summarise(name, tests, seconds)


def grade(path: Path, tests_dir: Path = TESTS, timeout: float = EXERCISE_TIMEOUT,
          only: list[str] | None = None) -> list[Result]:
    """Grade every exercise of the notebook at ``path``."""
    import nbformat

    from distlab import notebook, sandbox

    nb = nbformat.read(path, as_version=4)
    cells = {name: source for name, source in notebook.exercises(nb).items()
             if not only or name in only}
    counts = _count_tests([tests_dir / f"test_{name}.py" for name in cells])
    user, _ = sandbox.unprivileged_user()
    results = []
    with tempfile.TemporaryDirectory(prefix="distlab-student-") as tmp:
        os.chmod(tmp, 0o755)  # readable by the user the student's code runs as
        module = Path(tmp) / f"student_{path.stem}.py"
        module.write_text(notebook.module_source(nb))
        module.chmod(0o644)
        for name, source in cells.items():
            runnable, blocked = counts.get(f"test_{name}.py", (0, 0))
            if notebook.is_untouched(source):
                results.append(Result(name, 0, runnable, "not attempted",
                                      "the cell still raises NotImplementedError", blocked))
            else:
                results.append(grade_exercise(name, module, tests_dir, timeout, runnable, user))
    return results


def _count_tests(test_files: list[Path]) -> dict[str, tuple[int, int]]:
    """file name → (tests this machine can run, tests blocked), without running any."""
    files = [f for f in test_files if f.exists()]
    if not files:
        return {}
    _, _, tests = _run_reported(["--collect-only", *map(str, files)], dict(os.environ), 300,
                                contained=False)  # collecting runs no student code
    counts: dict[str, list[int]] = {}
    for t in tests or []:
        entry = counts.setdefault(Path(t["test"].split("::")[0]).name, [0, 0])
        entry[t["outcome"] == "blocked"] += 1
    return {name: (c[0], c[1]) for name, c in counts.items()}


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

    from distlab import sandbox

    parser = argparse.ArgumentParser(prog="python -m distlab.grade",
                                     description="Grade lab notebooks.")
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=EXERCISE_TIMEOUT,
                        help="seconds for the tests of one exercise (default %(default)s)")
    parser.add_argument("--exercise", action="append", help="grade only this exercise")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    sandbox.make_non_dumpable()
    user, why = sandbox.unprivileged_user()
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
