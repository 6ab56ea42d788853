"""The grader's pytest plugin (``-p distlab.grading.plugin``): streams each exercise
test's outcome, and the first failing check in plain words, to the grader through a
pipe, with the evidence of a passed test's traffic ("wire": bytes counted outside the
ranks, :mod:`distlab.grading.wire`; "self-reported": only a CommLog a rank returned);
reports tests of a tier this machine cannot run as "blocked"; stops an
exercise's tests once they have used up its time."""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import pytest

EXERCISE_TIMEOUT = 300.0  # seconds for all the tests of one exercise


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
                     help="comma-separated exercises to count but not run (not attempted, "
                          "missing, or a cell that does not compile)")
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
    if isinstance(exc, MemoryError) or (isinstance(exc, (RankError, RuntimeError)) and (
            getattr(exc, "exc_type", "") == "MemoryError" or "can't allocate memory" in str(exc)
            or "Cannot allocate memory" in str(exc))):
        limit = os.environ.get("DISTLAB_GRADE_MEMORY_MB")
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return "out of memory", (f"out of memory: {first}" + (
            f" (each graded rank may allocate {limit} MiB beyond what it starts with)" if limit else ""))
    if isinstance(exc, NotImplementedError) or (
            isinstance(exc, RankError) and exc.exc_type == "NotImplementedError"):
        return "not attempted", "not implemented yet (raise NotImplementedError)"
    if isinstance(exc, RankError):
        from distlab.grading import output

        return "error", output.rank_error(exc)
    if isinstance(exc, RankCrashed):
        first, *rest = str(exc).splitlines()
        hint = rest[0] if rest and rest[0].startswith("An abort") else ""
        return "error", f"{first} {hint}".strip()
    if isinstance(exc, AssertionError):
        return "fail", (str(exc).split("\nassert ")[0].strip() or "a check failed").splitlines()[0]
    return "error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _refused(exc) -> tuple[str, str] | None:
    """("refused", message) when the test reached one of the library's answers, absent
    while grading (:mod:`distlab.runtime.absent`): such an exercise scores 0 (and points
    at no hint)."""
    from distlab.grading.answers import REFUSAL

    for line in str(exc).splitlines():
        if REFUSAL in line:
            return "refused", line[line.index(REFUSAL):].strip()
    return None


def _evidence_marks() -> tuple[int, int, int]:
    """(CommLogs rebuilt from ranks' records, wire checks with bytes counted, without)
    in this process so far: a test that rebuilt a log, or made a wire check with nothing
    counted, and made no counted wire check passed on self-reported traffic."""
    from distlab import comm
    from distlab.grading import wire

    return (comm.logs_rebuilt(), *wire.checks_made())


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
        self.current: str | None = None  # the exercise whose tests run now
        self.marks = (0, 0, 0)  # _evidence_marks() when the test started

    def _write(self, record: dict) -> None:
        if "test" in record:
            record["exercise"] = self.exercise.get(record["test"], "")
        self.out.write(json.dumps(record) + "\n")

    def pytest_collection_modifyitems(self, config, items):
        gc.freeze()  # torch and the tests, imported: no collection walks them again
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
        if name != self.current:
            from distlab import launch

            # Fresh ranks for each exercise: ranks that ran the student's code for one
            # exercise never serve another. The grader's watchdog times it from here.
            launch.shutdown(graceful=False)
            self.current = name
            self._write({"start": name})
        self.marks = _evidence_marks()
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
            report.distlab_verdict = (_refused(call.excinfo.value) or
                                      _verdict_of(call.excinfo.value))

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
            from distlab.grading import wire

            logs, counted, uncounted = (now - then for now, then in
                                        zip(_evidence_marks(), self.marks))
            self._write({"test": report.nodeid, "outcome": "passed", "message": "",
                         "evidence": wire.evidence_of(logs > 0, counted > 0, uncounted > 0)})
        else:
            kind, message = getattr(report, "distlab_verdict", ("error", "the test broke"))
            self._write({"test": report.nodeid, "outcome": kind, "message": message})

    def pytest_sessionfinish(self, session, exitstatus):
        from distlab import launch

        launch.shutdown(graceful=False)  # no rank of this run is left when the end is sent
        self._write({"end": True})
        self.out.close()
        self.exitstatus = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config):
        """The run's last act: it exits without tearing its interpreter down (unloading
        torch costs about 0.7 CPU-seconds, a fifth of a small lab's grading, and there is
        nothing left to release: the report is closed and the ranks are gone)."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(self, "exitstatus", 3))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """In a grading run, before any conftest or test is imported: the ranks' fork server
    is forked from this process, which then holds only pytest, this plugin and torch,
    and the two share one import of torch (about 2 CPU-seconds a run)."""
    if os.environ.get("DISTLAB_SANDBOX") == "1":
        from distlab.runtime import rankproc

        rankproc.prefork()


def pytest_configure(config):
    fd = config.getoption("--distlab-report-fd", default=None)
    if fd is not None:
        from distlab.runtime import privileges

        privileges.make_non_dumpable()
        untouched = {n for n in config.getoption("--distlab-untouched").split(",") if n}
        config.pluginmanager.register(
            _Recorder(fd, untouched, config.getoption("--distlab-exercise-timeout")),
            "distlab-recorder")
