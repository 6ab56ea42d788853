"""The autograder: extract a notebook's exercises, run their tests, report.

    python -m distlab.grading labs/03_ring_allreduce.ipynb [--json report.json]
    python -m distlab.grading labs --lab 3 --json grade-report.json   # make grade LAB=3

A folder stands for its notebooks; ``--lab`` keeps those of one lab (:func:`lab_named`).
A usage error (no notebook, no such lab or exercise) exits 2 and writes no report.

The lab is named by the notebook's file name, which must start with a lab's name
(``03_ring_allreduce.ipynb``, ``03_ring_allreduce-alice.ipynb``); the lab's exercises,
and so the maximum, come from the kit (the exercise tests that declare that lab, see
:mod:`distlab.grading.labs`), never from the notebook.
An exercise whose cell is missing (or lost its nbgrader metadata) scores 0 of its full
count ("missing"); one whose cell does not compile scores 0 of it too ("syntax error",
with the line and column in the cell; found by the grader, its tests not run); an
exercise cell of another lab is listed as "ignored" and earns nothing; a file name that
starts with no lab's name is not graded (an error, exit 1).

Each exercise of the lab is tested by ``exercises/test_<name>.py`` (beside this module,
so installed with the package) in a contained ``pytest`` process, against a module made
of the notebook's exercise cells. Every test is worth one point. Tiers: cpu (gloo,
always), gpu, multigpu; tests of a tier this machine cannot run are "blocked", not failed.

Time: each exercise's tests get ``--timeout`` seconds. The plugin skips the rest of an
exercise's tests once they have used its time; and the grader times each exercise on its
own clock from the moment its tests start: past the limit plus a grace of 10-30 s it
stops the whole run, whatever it is stuck on (student code cannot extend that), reports
the exercise's unfinished tests as "timeout", and reruns the exercises not yet started.

Memory: each graded rank may hold ``--memory`` MiB of data beyond what it starts with
(RLIMIT_DATA, set before the student's module is imported, soft and hard); an exercise
whose failures are allocations refused is reported as "out of memory".

Isolation: each exercise's tests run on ranks of their own (the warm ranks are thrown
away between exercises, and after any failure), with the library's answers to that
exercise refusing. What the grader guarantees against students' code, under which
conditions, and what it does not, is in :mod:`distlab.grading.sandbox`.

Output: every string the student's code can influence (messages, names) is printed with
control characters escaped (:func:`shown`); the JSON report carries them exactly. The
JSON is written whole or not at all, under a fresh name created with
O_CREAT|O_EXCL|O_NOFOLLOW in the target's folder and renamed over the target; a folder
other users can write is refused unless sticky and owned by the grader or root
(:func:`distlab.grading.output.write_report`).

Beside an exercise's first failing check the report names the hint to open
(:mod:`distlab.grading.hints`), and the points whose traffic evidence is only a CommLog
the ranks returned are counted as "self-reported" (:mod:`distlab.grading.wire`).

The pytest process loads :mod:`distlab.grading.plugin`, which streams each test's
outcome and its first failing check in plain words back through a pipe.

Hidden tests: ``--hidden-tests DIR`` adds an instructor's own test files to the kit's
(:mod:`distlab.grading.hidden`), one point per test of the exercise they name; graded ranks never
see them.
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

from distlab.grading import answers
from distlab.grading.hidden import HiddenTests
from distlab.grading.plugin import EXERCISE_TIMEOUT
from distlab.runtime import absent

TESTS = Path(__file__).resolve().parent / "exercises"  # installed with the package


@dataclasses.dataclass
class Result:
    exercise: str
    points: int
    max_points: int
    verdict: str   # pass, partial, fail, deadlock, not attempted, syntax error (the cell
    #                does not compile: its tests counted, none run), missing, error, timeout,
    #                out of memory, blocked, ignored (another lab's cell: worth nothing here),
    #                refused (it called the library's answer: 0 points, no hint)
    message: str   # the first failing check, in plain words
    blocked: int = 0  # tests this machine could not run
    seconds: float = 0.0
    self_reported: int = 0  # points whose traffic evidence is only the ranks' own CommLog
    failed_test: str = ""   # the first failing test's id
    hint: str = ""          # the hint to open for it (:mod:`distlab.grading.hints`)


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
    refused = [t for t in failed if t["outcome"] == "refused"]
    if refused:  # the library's answer was called: nothing of the exercise counts
        return Result(name, 0, len(ran), "refused", refused[0]["message"], len(blocked),
                      seconds, failed_test="")
    if not failed:
        verdict, message = "pass", ""
    else:
        kinds = {t["outcome"] for t in failed}
        first = failed[0]
        verdict = ("not attempted" if kinds == {"not attempted"} and not passed else
                   "deadlock" if "deadlock" in kinds else
                   "out of memory" if "out of memory" in kinds and not passed else
                   "timeout" if "timeout" in kinds and not passed else
                   "partial" if passed else "fail")
        message = next((t for t in failed if t["outcome"] == "deadlock"), first)["message"]
        message = f"{first['test'].split('::')[-1]}: {message}" if verdict != "not attempted" \
            else message
    return Result(name, len(passed), len(ran), verdict, message, len(blocked), seconds,
                  sum(t.get("evidence") == "self-reported" for t in passed),
                  failed[0]["test"] if failed else "")


PLUGIN = "distlab.grading.plugin"


def _pytest(report_fd: int, tests_dir: Path, *args: str) -> list[str]:
    """A pytest command line whose outcomes the grader's plugin streams to ``report_fd``."""
    # --capture=no: what the ranks print (capped per launch) streams to the grader, which
    # keeps a capped tail, instead of piling up in pytest's captured reports
    return [sys.executable, "-m", "pytest", "-q", "--capture=no", "-p", PLUGIN,
            "-p", "no:cacheprovider",
            f"--distlab-report-fd={report_fd}", f"--rootdir={tests_dir}", *args]


WATCHDOG_GRACE = 30.0  # seconds past an exercise's time limit before the grader stops it


def _grace(timeout: float) -> float:
    return min(WATCHDOG_GRACE, max(10.0, timeout))


def _run_reported(args: list[str], env: dict, timeout: float, tests_dir: Path,
                  exercise_timeout: float) -> tuple[int | None, str, list[dict], str | None]:
    """Run pytest with ``args`` under :func:`distlab.grading.sandbox.run_contained`; (exit
    status or None when stopped, output, the records it streamed, the exercise the
    watchdog stopped or None).

    The watchdog times each exercise on the grader's own clock, from the record that says
    its tests start: past ``exercise_timeout`` plus a grace, the whole run is stopped,
    whatever it was doing (a launcher stuck on a file the student's code replaced, a
    plugin that did not get to check its budget)."""
    from distlab.grading import sandbox

    read, write = os.pipe()
    stream: list[bytes] = []
    current: list = [None, 0.0]  # exercise, when it started (the grader's clock)
    stop, done = threading.Event(), threading.Event()
    overran: list[str] = []

    def reader():
        pending = b""
        for chunk in iter(lambda: os.read(read, 1 << 16), b""):
            stream.append(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b'{"start":'):
                    try:
                        current[:] = [json.loads(line)["start"], time.monotonic()]
                    except (ValueError, KeyError, TypeError):
                        pass

    def watchdog():
        limit = exercise_timeout + _grace(exercise_timeout)
        while not done.wait(0.25):
            name, since = current
            if name is not None and time.monotonic() - since > limit:
                overran.append(name)
                stop.set()
                return

    threads = [threading.Thread(target=reader, daemon=True),
               threading.Thread(target=watchdog, daemon=True)]
    for t in threads:
        t.start()
    try:
        code, out = sandbox.run_contained(_pytest(write, tests_dir, *args), env=env, cwd=tests_dir,
                                          timeout=timeout, pass_fds=[write], stop=stop)
    finally:
        done.set()
        os.close(write)
        threads[0].join(10)
        os.close(read)
    records = []
    for line in b"".join(stream).decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return code, out, records, (overran[0] if overran else None)


MISSING = ("the exercise cell for {name} is missing or lost its nbgrader metadata: restore "
           "it from git (its tests count, none ran)")


def memory_limit_mb() -> int:
    """MiB of data each graded rank may allocate (``DISTLAB_GRADE_MEMORY_MB``, else an eighth
    of the machine's memory and at least 2 GiB: four ranks then take at most half)."""
    if os.environ.get("DISTLAB_GRADE_MEMORY_MB"):
        return int(os.environ["DISTLAB_GRADE_MEMORY_MB"])
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError):
        total = 16384
    return max(2048, total // 8)


def run_groups(exercises: list[str], needs: dict[str, set[str]]) -> list[list[str]]:
    """``exercises`` in groups that one contained run can grade together: those whose
    answers are in the same modules (lab 03's three, the two layers of lab 06, lab 07's
    schedules), so that the ranks of each lack exactly its own answers; and none whose
    ranks import (``needs``, its tests' ``RANK_IMPORTS``) one of those modules. In the
    order given."""
    groups: list[list[str]] = []
    for name in exercises:
        held = answers.modules_of([name])
        group = next((g for g in groups if answers.modules_of(g[:1]) == held), None)
        if group is None or any(needs[n] & set(held) for n in group + [name]):
            groups.append([name])
        else:
            group.append(name)
    return groups


NOTEBOOK_TIMEOUT = 4 * EXERCISE_TIMEOUT  # seconds for all the exercises of one notebook


def grade(path: Path, tests_dir: Path = TESTS, timeout: float = EXERCISE_TIMEOUT,
          only: list[str] | None = None, memory_mb: int | None = None,
          first_failure: bool = False, total: float = NOTEBOOK_TIMEOUT,
          hidden: HiddenTests | None = None) -> list[Result]:
    """Grade the notebook at ``path`` on exactly its lab's exercises (the lab is named by
    the file name, its exercises by the tests of ``tests_dir`` that declare it,
    :func:`distlab.grading.labs.exercises`; never by the notebook): a contained pytest
    run per group of exercises (:func:`run_groups`; one for most labs), whose ranks never
    hold the library's answers to them (:func:`distlab.grading.answers.absent_spec`), each
    exercise's tests limited to ``timeout`` seconds, each graded rank's data to
    ``memory_mb`` MiB (default :func:`memory_limit_mb`). An exercise whose cell is missing, or does not compile (:func:`distlab.grading.notebook.compile_problem`),
    scores 0 of its tests, counted and not run; an exercise cell of another lab is reported
    as ignored; a notebook whose name is no lab's gets one "error" row and nothing else.
    ``first_failure``: stop at the first failing test (the message a student reads first;
    the tests after it count as not run), as the kit's tests of wrong answers grade.
    ``total``: seconds for the whole notebook, from the moment it is read (reading and
    parsing count); the exercises it leaves count as timed out.
    ``hidden``: an instructor's tests (:func:`distlab.grading.hidden.hidden_tests`), run with the kit's (from its
    copy of them) and counted as theirs.
    The notebook is read by :func:`distlab.grading.notebook.read_submission` (raises
    its SubmissionError)."""
    from distlab.grading import hints, labs, notebook, sandbox
    from distlab.runtime import privileges

    deadline = time.monotonic() + total  # reading and parsing the notebook count too
    if hidden:
        tests_dir = hidden.tests_dir
    extra = hidden.files if hidden else {}
    every = labs.exercises(tests_dir)
    lab = labs.lab_of(path, every)
    if lab is None:
        return [Result(Path(path).name, 0, 0, "error", labs.unknown_lab_message(path, every))]
    nb = notebook.read_submission(path)
    found = notebook.exercises(nb)
    wanted = [name for name in every[lab] if not only or name in only]
    results_first = [Result(name, 0, 0, "error", f"{name} is not an exercise of {lab} (its "
                                                 f"exercises: {', '.join(every[lab])})")
                     for name in (only or []) if name not in every[lab]]
    foreign = [name for name in found if name not in every[lab]]
    files = {name: tests_dir / f"test_{name}.py" for name in wanted}
    missing = {name for name, f in files.items() if not f.exists()}
    lost = {name for name in wanted if name not in found}  # the cell or its metadata is gone
    problems = {name: notebook.compile_problem(name, found[name]) for name in wanted
                if name in found}
    broken = {name: problem for name, problem in problems.items() if problem}  # no compile
    untouched = {name for name in wanted if name in found and name not in broken
                 and notebook.is_untouched(found[name])}
    counted_only = (untouched | lost | set(broken)) - missing  # collected for the count, never run
    user, _ = privileges.unprivileged_user()
    runs: dict[str, tuple] = {}  # exercise → (exit status, output, ended) of its run
    records: list[dict] = []
    overran: set[str] = set()
    seconds: dict[str, float] = {}
    to_run = [name for name in wanted if name not in missing | counted_only]
    with tempfile.TemporaryDirectory(prefix="distlab-grade-") as tmp:
        os.chmod(tmp, 0o755)  # readable by the user the student's code runs as
        module = Path(tmp) / f"student_{path.stem}.py"
        prelude = notebook.imports(nb)
        module.write_text(notebook.module_source(nb, prelude, problems))
        module.chmod(0o644)
        run_dir = Path(tmp) / "tmp"
        run_dir.mkdir(mode=0o711)  # the ranks' own folders go here, and go with it
        # PYTEST_DISABLE_PLUGIN_AUTOLOAD: the run loads the grader's plugin and no other
        # (nbval's import alone, through nbformat and jsonschema, costs ~1.5 s per run)
        env = dict(sandbox.run_environment(), DISTLAB_STUDENT=str(module), DISTLAB_SANDBOX="1",
                   DISTLAB_SANDBOX_USER=user, TMPDIR=str(run_dir), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
                   DISTLAB_GRADE_MEMORY_MB=str(memory_mb or memory_limit_mb()))
        every_file = [f for n in wanted if n not in missing
                      for f in (files[n], *extra.get(n, ()))]
        needs = {n: {m for f in (files[n], *extra.get(n, ())) for m in labs.rank_imports(f)}
                 for n in to_run}
        pending = run_groups(to_run, needs) or [[]]
        # one contained run per group, whose ranks' fork server never held the answers to
        # any exercise of it (distlab.runtime.absent); the first also collects (never
        # runs) every other exercise's tests, so that each is counted even where the
        # notebook's time runs out
        made = 0
        while pending and time.monotonic() < deadline:
            group = pending.pop(0)
            mine = [f for n in group for f in (files[n], *extra.get(n, ()))]
            spec_dir = Path(tmp) / f"run{made}"
            spec_dir.mkdir(mode=0o755)
            run_env = dict(env, **sandbox.rank_sandbox(
                spec_dir, module, user, prelude,
                sorted(set().union(*(needs[n] for n in group))), hidden.unseen if hidden else ()))
            run_env[absent.ENV] = json.dumps(answers.absent_spec(group))
            start = time.monotonic()
            code, out, got, stopped = _run_reported(
                [f"--distlab-untouched={','.join(n for n in wanted if n not in group)}",
                 f"--distlab-exercise-timeout={timeout}",
                 *(["--maxfail=1"] if first_failure else []),
                 *map(str, every_file if made == 0 else mine)],
                run_env, min(timeout * max(len(group), 1) + 120, deadline - time.monotonic()),
                tests_dir, timeout)
            made += 1
            records += got
            started = [r["start"] for r in got if "start" in r]
            ended = any(r.get("end") for r in got)
            for name in group:  # an exercise that never started in a stopped run runs again
                if name in started or not stopped:
                    runs[name] = (code, out, ended)
                    seconds[name] = (time.monotonic() - start) / len(group)
            if stopped:
                overran.add(stopped)
                rest = [name for name in group if name not in started]
                if rest:
                    pending.append(rest)
    out_of_time = time.monotonic() >= deadline
    collected: dict[str, dict] = {}
    for r in records:
        for c in r.get("collected", []) if isinstance(r.get("collected"), list) else []:
            if isinstance(c, dict) and isinstance(c.get("test"), str):
                collected.setdefault(c["test"], c)
    outcomes = {r["test"]: r for r in records if "outcome" in r}
    results = results_first
    for name in wanted:
        mine = [c for c in collected.values() if c.get("exercise") == name]
        runnable = sum(not c["blocked"] for c in mine)
        code, out, ended = runs.get(name, (None, "", False))
        broke = (f"the notebook's grading used its {total:g} s before these tests finished"
                 if code is None and out_of_time else
                 "the tests did not finish within their time limit" if code is None else
                 f"the test run ended before this test (exit status {code}): "
                 f"{' | '.join(out.strip().splitlines()[-2:])}")
        if name in missing:
            results.append(Result(name, 0, 0, "error", f"no tests for this exercise "
                                                        f"({files[name]} missing)"))
        elif name in lost:
            results.append(Result(name, 0, runnable, "missing", MISSING.format(name=name),
                                  len(mine) - runnable))
        elif name in broken:
            results.append(Result(name, 0, runnable, "syntax error", broken[name],
                                  len(mine) - runnable))
        elif name in untouched:
            results.append(Result(name, 0, runnable, "not attempted",
                                  "the cell still raises NotImplementedError", len(mine) - runnable))
        elif not mine and out_of_time and name not in runs:  # no run began: count them apart
            cpu, gpu = labs.test_counts([name], tests_dir)[name]
            results.append(Result(name, 0, cpu, "timeout", broke, gpu))
        elif not mine:
            results.append(Result(name, 0, 0, "error", "its tests could not be collected: " +
                                  " | ".join(out.strip().splitlines()[-3:])))
        else:
            late = (f"the tests of this exercise did not finish within {timeout:g} s; the "
                    f"grader stopped them" if name in overran else None)
            tests = [outcomes.get(c["test"]) or (
                {"test": c["test"], "outcome": "blocked", "message": c["blocked"]} if c["blocked"]
                else {"test": c["test"], "outcome": "timeout" if code is None else "error",
                      "message": late or (broke if not ended else "the test reported no outcome")})
                     for c in mine]
            results.append(_summarise(name, tests, seconds.get(name, 0.0)))
            if results[-1].failed_test:
                declared = hints.declared(tests_dir / results[-1].failed_test.split("::")[0])
                results[-1].hint = hints.pointer(declared, hints.titles(nb, name),
                                                 results[-1].failed_test, name, results[-1].message)
    for name in foreign:
        owner = next((other for other, names in every.items() if name in names), None)
        results.append(Result(name, 0, 0, "ignored", (
            f"not an exercise of {lab}" + (f" (it belongs to {owner})" if owner else "") +
            ": ignored, it earns nothing here")))
    return results
