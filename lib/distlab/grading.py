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
                     help="stream per-test outcomes (JSON lines) to this inherited descriptor")
    parser.addoption("--distlab-untouched", default="",
                     help="comma-separated exercises to count but not run (not attempted)")
    parser.addoption("--distlab-exercise-timeout", default=EXERCISE_TIMEOUT, type=float,
                     help="seconds for all the tests of one exercise")


def _verdict_of(exc) -> tuple[str, str]:
    """(kind, plain message) for an exception raised by a test."""
    from distlab.launch import LaunchTimeout, RankCrashed, RankError

    if isinstance(exc, LaunchTimeout):
        where = "; ".join(f"rank {r} {w}" for r, w in sorted(exc.where.items()))
        if all(w.startswith(("running", "computing")) and "issued async" not in w
               for w in exc.where.values()):
            return "timeout", (f"no answer within {exc.timeout:g} s, and no rank was waiting "
                               f"for another: an endless loop, or far too slow ({where})")
        waiting = any("issued async" in w for w in exc.where.values())
        return "deadlock", f"deadlock: no answer within {exc.timeout:g} s ({where})" + (
            "; a rank whose last call was an async collective is waiting for it to finish"
            if waiting else "")
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


def exercise_of(test_file: str) -> str:
    """``.../test_NAME.py`` → ``NAME``."""
    return Path(test_file).stem.removeprefix("test_")


class _Recorder:
    """Streams, as JSON lines to a pipe: the collected tests (and which this machine
    cannot run), then each test's outcome and plain-words message, then the end. The
    tests of untouched exercises are counted, not run; an exercise whose tests have used
    up its time has the rest reported as timed out."""

    def __init__(self, fd: int, untouched: set[str], budget: float):
        self.out = os.fdopen(fd, "w", buffering=1)
        self.untouched, self.budget = untouched, budget
        self.spent: dict[str, float] = {}
        self.exercise: dict[str, str] = {}  # test id → exercise

    def _write(self, record: dict) -> None:
        if "test" in record:
            record["exercise"] = self.exercise.get(record["test"], "")
        self.out.write(json.dumps(record) + "\n")

    def pytest_collection_modifyitems(self, config, items):
        self.exercise = {item.nodeid: exercise_of(str(item.path)) for item in items}
        self._write({"collected": [{"test": item.nodeid, "exercise": self.exercise[item.nodeid],
                                    "blocked": blocked_reason(item) or ""} for item in items]})
        skipped = [item for item in items if self.exercise[item.nodeid] in self.untouched]
        if skipped:
            items[:] = [item for item in items if item not in skipped]
            config.hook.pytest_deselected(items=skipped)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        name = self.exercise.get(item.nodeid, "")
        if self.spent.get(name, 0.0) > self.budget:
            self._write({"test": item.nodeid, "outcome": "timeout", "message":
                         f"the tests of this exercise did not finish within {self.budget:g} s "
                         f"(a deadlock the tests did not catch, or far too slow)"})
            yield
            return
        start = time.monotonic()
        yield
        self.spent[name] = self.spent.get(name, 0.0) + time.monotonic() - start

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        if self.spent.get(self.exercise.get(item.nodeid, ""), 0.0) > self.budget:
            pytest.skip("timeout")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.excinfo is not None and report.failed:
            report.distlab_verdict = _verdict_of(call.excinfo.value)

    def pytest_runtest_logreport(self, report):
        if self.spent.get(self.exercise.get(report.nodeid, ""), 0.0) > self.budget:
            return  # already reported as timed out
        if report.when != "call" and report.outcome == "passed":
            return
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            reason = reason.removeprefix("Skipped: ")
            kind = "blocked" if reason.startswith("blocked") else "skipped"
            self._write({"test": report.nodeid, "outcome": kind, "message": reason})
        elif report.passed:
            self._write({"test": report.nodeid, "outcome": "passed", "message": ""})
        else:
            kind, message = getattr(report, "distlab_verdict", ("error", "the test broke"))
            self._write({"test": report.nodeid, "outcome": kind, "message": message})

    def pytest_sessionfinish(self, session):
        from distlab import launch

        launch.shutdown(graceful=False)  # no rank of this run is left when the end is sent
        self._write({"end": True})
        self.out.close()


def pytest_configure(config):
    fd = config.getoption("--distlab-report-fd", default=None)
    if fd is not None:
        from distlab import sandbox

        sandbox.make_non_dumpable()
        untouched = {n for n in config.getoption("--distlab-untouched").split(",") if n}
        config.pluginmanager.register(
            _Recorder(fd, untouched, config.getoption("--distlab-exercise-timeout")),
            "distlab-recorder")


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
                   "timeout" if "timeout" in kinds and not passed else
                   "partial" if passed else "fail")
        message = next((t for t in failed if t["outcome"] == "deadlock"), first)["message"]
        message = f"{first['test'].split('::')[-1]}: {message}" if verdict != "not attempted" \
            else message
    return Result(name, len(passed), len(ran), verdict, message, len(blocked), seconds)


def _pytest(report_fd: int, *args: str) -> list[str]:
    """A pytest command line whose outcomes this module's plugin streams to ``report_fd``."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "distlab.grading", "-p",
            "no:cacheprovider", f"--distlab-report-fd={report_fd}", f"--rootdir={ROOT}", *args]


def _run_reported(args: list[str], env: dict, timeout: float) -> tuple[int | None, str, list[dict]]:
    """Run pytest with ``args`` under :func:`distlab.sandbox.run_contained`; (exit status or
    None on timeout, output, the records it streamed)."""
    from distlab import sandbox

    read, write = os.pipe()
    stream: list[bytes] = []
    reader = threading.Thread(target=lambda: stream.extend(iter(
        lambda: os.read(read, 1 << 16), b"")), daemon=True)
    reader.start()
    try:
        code, out = sandbox.run_contained(_pytest(write, *args), env=env, cwd=ROOT,
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

    from distlab import notebook, sandbox

    nb = nbformat.read(path, as_version=4)
    cells = {name: source for name, source in notebook.exercises(nb).items()
             if not only or name in only}
    files = {name: tests_dir / f"test_{name}.py" for name in cells}
    missing = {name for name, f in files.items() if not f.exists()}
    untouched = {name for name, source in cells.items() if notebook.is_untouched(source)}
    user, _ = sandbox.unprivileged_user()
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
            env, timeout * attempted + 120)
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
