"""The autograder: full marks for solutions, zero for untouched labs, and a wrong, a
deadlocking or a runaway answer each reported for what it is, within its time limit."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from distlab.grading import cli, notebook, output, runner, sandbox

ROOT = Path(__file__).resolve().parents[1]


def _lab00_with(tmp_path, body: str) -> Path:
    """Lab 00 with the student's answer to all_reduce_mean replaced by ``body``."""
    nb = nbformat.read(ROOT / "solutions" / "00_setup.ipynb", as_version=4)
    for cell in nb.cells:
        if notebook.grade_id(cell) == "all_reduce_mean":
            cell.source = "def all_reduce_mean(tensor, group=None):\n" + body
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_wrong_answer_fails_with_the_first_check_in_plain_words(tmp_path):
    path = _lab00_with(tmp_path, "    dist.all_reduce(tensor, group=group)\n    return tensor\n")
    (r,) = runner.grade(path, only=["all_reduce_mean"])
    assert r.verdict in ("partial", "fail") and r.points < r.max_points
    assert r.points >= 1, "world size 1 is right even without dividing"
    assert "elements are wrong" in r.message and "mean over the" in r.message, r.message


def test_a_deadlock_is_reported_as_such_within_the_time_limit(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_all_reduce_mean.py").write_text(
        "import torch\nfrom distlab import launch\nNOTEBOOK = '00_setup'\n\n"
        "def _call(fn):\n    fn(torch.ones(3))\n\n"
        "def test_two_ranks(student):\n"
        "    launch.run(_call, 2, student.all_reduce_mean, backend='gloo', timeout=3)\n")
    (tests / "conftest.py").write_text((runner.TESTS / "conftest.py").read_text())
    path = _lab00_with(tmp_path, "    if dist.get_rank() == 0:\n"
                                 "        dist.all_reduce(tensor, group=group)\n    return tensor\n")
    (r,) = runner.grade(path, tests_dir=tests)
    assert r.seconds < 120, "the 3 s launch timeout, not the exercise's 300 s, ended it"
    assert r.verdict == "deadlock" and r.points == 0
    assert "rank 0 waiting in all_reduce" in r.message, r.message


def test_a_runaway_answer_is_stopped_by_the_exercise_time_limit(tmp_path):
    path = _lab00_with(tmp_path, "    import time\n    time.sleep(3600)\n")
    (r,) = runner.grade(path, timeout=2)
    assert r.seconds < 2 + 90, "stopped soon after the exercise's time limit"
    assert r.verdict == "timeout" and r.points == 0, r
    assert "endless loop" in r.message or "within 2 s" in r.message, r.message
    assert r.max_points >= 5, "a run that never reported keeps its points in the maximum"


def test_the_notebooks_time_limit_covers_reading_and_parsing_it(tmp_path, monkeypatch):
    """A notebook whose reading takes longer than its whole time limit runs nothing: every
    exercise counts as timed out (the clock starts before the notebook is read)."""
    path = _lab00_with(tmp_path, "    return tensor\n")
    read, runs = notebook.read_submission, []

    def slow_read(p):
        time.sleep(1.5)
        return read(p)

    monkeypatch.setattr(notebook, "read_submission", slow_read)
    monkeypatch.setattr(runner, "_run_reported", lambda *a, **k: runs.append(a) or (0, "", [], None))
    (r,) = runner.grade(path, total=1.0)
    assert runs == [], "a contained run started after the notebook's time was spent reading it"
    assert (r.verdict, r.points) == ("timeout", 0) and r.max_points >= 5, r
    assert "used its 1 s" in r.message, r.message


def test_a_cell_that_does_not_compile_is_its_own_verdict_beside_the_others(tmp_path):
    """Lab 07 with a syntax error (under a magic line), a wrong answer and a right one."""
    broken = ("%load_ext autoreload\ndef gpipe_schedule(num_stages, num_microbatches):\n"
              "    m = num_microbatches\n    x = (1,\n    return [[]]\n")
    nb = nbformat.read(ROOT / "solutions" / "07_pipeline_parallel.ipynb", as_version=4)
    for cell in nb.cells:
        if notebook.grade_id(cell) == "gpipe_schedule":
            cell.source = broken
        elif notebook.grade_id(cell) == "bubble_fraction":
            cell.source = "def bubble_fraction(p, m):\n    return p / (m + p)\n"
    path = tmp_path / "07_pipeline_parallel.ipynb"
    nbformat.write(nb, path)
    names = ["gpipe_schedule", "one_f_one_b_schedule", "bubble_fraction"]
    syntax, right, wrong = runner.grade(path, only=names)
    assert (right.verdict, right.points) == ("pass", right.max_points), right
    assert wrong.verdict in ("partial", "fail") and wrong.points < wrong.max_points, wrong
    line = broken.split("\n").index("    x = (1,") + 1  # in the cell, the magic line counted
    column = "    x = (1,".index("(") + 1
    assert (syntax.verdict, syntax.points, syntax.hint) == ("syntax error", 0, ""), syntax
    assert syntax.max_points >= 5, "its tests are counted"
    assert syntax.message.startswith(
        f"line {line}, column {column} of your gpipe_schedule cell: "), syntax.message
    assert syntax.message.count("line ") == 1 and "raise SyntaxError" not in syntax.message
    table = output.table([syntax]).splitlines()
    code, caret = table[3], table[4]  # under the header and the row: the line, the caret
    assert code.strip() == "x = (1," and code[caret.index("^")] == "(", "\n".join(table)


def test_no_arguments_says_how_to_grade(capsys):
    assert cli.main([]) == 2
    said = capsys.readouterr().err
    assert "make grade LAB=03" in said and "python -m distlab.grading labs/" in said, said


@pytest.mark.parametrize("given", ["3", "03", "03_ring_allreduce"])
def test_a_lab_is_named_by_its_name_or_its_number(given):
    from distlab.grading import labs

    assert cli.lab_named(given, labs.exercises()) == "03_ring_allreduce"


@pytest.mark.parametrize("args, says", [
    (["--lab", "13"], "--lab 13 is not a lab. The labs: 00_setup, "),
    (["--lab", "3_ring"], "did you mean 03_ring_allreduce?"),
    (["--lab", "01", "labs/00_setup.ipynb"], "no notebook of 01_primitives in labs/00_setup.ipynb"),
    (["--lab", "0", "--exercise", "ring_allreduce"], "--exercise ring_allreduce: no such exercise"),
    (["docs"], "no notebook (*.ipynb) in docs")])
def test_a_usage_error_exits_2_and_keeps_the_report(tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.chdir(ROOT)
    report = tmp_path / "report.json"
    report.write_text("the last report")
    argv = args if any(a.startswith(("labs", "docs")) for a in args) else ["labs", *args]
    assert cli.main([*argv, "--json", str(report)]) == 2
    assert says in capsys.readouterr().err
    assert report.read_text() == "the last report"


def test_a_folder_and_a_lab_number_grade_that_labs_notebooks(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "distlab.grading", "labs", "--lab", "0",
                          "--json", str(report)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert list(json.loads(report.read_text())) == ["labs/00_setup.ipynb"]


def test_the_command_line_prints_a_table_and_writes_json(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "distlab.grade", "labs/00_setup.ipynb",
                          "--json", str(report)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all_reduce_mean" in out.stdout and "not attempted" in out.stdout
    data = json.loads(report.read_text())["labs/00_setup.ipynb"]["all_reduce_mean"]
    assert set(data) == {"points", "max", "verdict", "message", "blocked", "hint",
                         "self_reported", "traffic"}
    assert data["points"] == 0 and data["hint"] == "" and data["self_reported"] == 0
    assert data["traffic"].startswith(("wire: ", "self-reported: "))


# ------------------------------------------------------------- the hint to open

_HINTED_TEST = """raise SystemExit("the grader imported this file")

HINTS = {"test_shards": 2, "test_named_badly": "two", "test_zero": 0, 3: 1}


def test_shards():
    pass
"""


def _hinted_notebook(title: str = "q and\n  k"):
    v4 = nbformat.v4
    cell = v4.new_code_cell("def ex():\n    pass\n")
    cell.metadata["nbgrader"] = {"grade_id": "ex", "solution": True}
    return v4.new_notebook(cells=[
        v4.new_markdown_cell("<details><summary>Hint 1: another exercise's</summary></details>"),
        v4.new_code_cell("x = 1"),
        v4.new_markdown_cell("## The exercise\nIts contract."),
        v4.new_markdown_cell("<details><summary>Hint 1: a nudge</summary>...</details>\n"
                             f"<details>\n<summary> Hint 2: {title} </summary>\n...</details>"),
        cell])


def test_the_hint_to_open_comes_from_the_kits_test_and_the_notebooks_titles(tmp_path):
    from distlab.grading import hints

    test_file = tmp_path / "test_ex.py"
    test_file.write_text(_HINTED_TEST)
    declared = hints.declared(test_file)  # read, never run (the file would exit)
    assert declared == {"test_shards": 2}, declared
    titles = hints.titles(_hinted_notebook(), "ex")
    assert titles == {1: "a nudge", 2: "q and k"}, titles
    assert hints.pointer(declared, titles, "test_ex.py::test_shards[3]", "ex") == \
        "open Hint 2 (q and k) under ex"
    assert hints.pointer(declared, titles, "test_ex.py::test_other", "ex") == \
        "open Hint 1 (a nudge) under ex"  # not listed: the first hint
    assert hints.pointer(declared, hints.titles(_hinted_notebook(), "other"),
                         "test_ex.py::test_shards", "other") == ""  # no hints, no pointer
    nasty = hints.titles(_hinted_notebook("\x1b[2Jtotal: 99/99"), "ex")
    shown = output.table([runner.Result("ex", 0, 1, "fail", "test_shards: wrong", hint=hints.pointer(
        declared, nasty, "test_ex.py::test_shards", "ex"))])
    assert "\u2192 open Hint 2 (\\x1b[2Jtotal: 99/99) under ex" in shown, shown
    assert "\x1b" not in shown


def test_self_reported_points_are_counted_and_say_why(monkeypatch):
    """Points resting on a CommLog the ranks returned are marked, with why the bytes were
    not counted: here a grader that is not root."""
    from distlab.grading import output

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert output.traffic_evidence().startswith("self-reported: the grader is not root")
    shown = output.table([runner.Result("zero2_step", 17, 20, "partial", "x", self_reported=3),
                          runner.Result("shard_range", 8, 8, "pass", "")])
    assert "17/20 (3 self-reported)" in shown and "8/8 " in shown, shown
    assert shown.splitlines()[-1] == (
        "self-reported: 3 of these points rest on traffic the ranks reported themselves "
        "(CommLog), which their code could forge; the grader is not root, so the ranks get "
        "no network of their own")
    monkeypatch.setattr(output, "traffic_evidence", lambda: "wire: bytes counted on a loopback")
    shown = output.table([runner.Result("ring_attention", 21, 21, "pass", "", blocked=1,
                                        self_reported=4)])
    assert "21/21 (+1 blocked) (4 self-reported)" in shown, shown
    assert shown.splitlines()[-2:] == [
        "self-reported: 4 of these points rest on traffic the ranks reported themselves "
        "(CommLog), which their code could forge; the tests behind them count no bytes on the "
        "wire (the other traffic points do)",
        "blocked: 1 test needs GPUs this machine lacks (the gpu tier one, multigpu two or "
        "more): it is left out of the points above and run where the GPUs are"]


def test_every_hint_the_kit_points_to_exists():
    """Each exercise test's HINTS names tests of that file and hints that the solution
    notebook has above the exercise."""
    import ast

    from distlab.grading import hints, labs

    wrong = []
    for lab, exercises in labs.exercises().items():
        nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
        for name in exercises:
            test_file = runner.TESTS / f"test_{name}.py"
            declared, titles = hints.declared(test_file), hints.titles(nb, name)
            body = ast.parse(test_file.read_text()).body  # defs, and names bound to tests
            tests = {node.name for node in body if isinstance(node, ast.FunctionDef)} | {
                n.id for node in body if isinstance(node, ast.Assign)
                for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)}
            wrong += [f"{name}: HINTS names {t}, which {test_file.name} does not define"
                      for t in declared if t not in tests | {"*"}]
            wrong += [f"{name}: HINTS points {t} to Hint {n}; the notebook has "
                      f"{sorted(titles) or 'no hints'} above the exercise"
                      for t, v in declared.items()
                      for n in (v.values() if isinstance(v, dict) else [v]) if n not in titles]
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------- students' code cannot forge its grade

_HOSTILE = r'''
import atexit, json, os, subprocess, sys

MARK = "{mark}"
FULL = json.dumps([{{"test": f"t{{i}}", "outcome": "passed", "message": ""}} for i in range(50)])


def _ancestors():
    pid, chain = os.getpid(), []
    while pid > 1:
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
        chain.append(pid)
    return chain


def _args():
    for pid in _ancestors():
        try:
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                yield pid, [a.decode(errors="replace") for a in f.read().split(b"\0")]
        except OSError:
            pass


def _forge():  # trick 1: overwrite the per-test report, wherever it can be found
    for pid, args in _args():
        for a in args:
            target = None
            if a.startswith("--distlab-report-fd="):
                target = f"/proc/{{pid}}/fd/{{a.split('=', 1)[1]}}"
            elif a.startswith("--distlab-report="):
                target = a.split("=", 1)[1]
            if target:
                try:
                    with open(target, "w") as f:
                        f.write(FULL)
                except OSError:
                    pass


atexit.register(_forge)
_forge()
try:
    os.remove("{sentinel}")
except OSError:
    pass
try:
    first = os.open(f"/var/tmp/{{MARK}}-started", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
except OSError:
    first = None
if first is not None:
    os.write(first, str(os.getuid()).encode())
    os.close(first)
    paths = [args[i + 1] for _, args in _args() for i, a in enumerate(args[:-1]) if a == "--json"]
    rewriter = (  # trick 2: outlive the grader and rewrite its JSON report
        "import json, sys, time\\n"
        "for _ in range(40):\\n"
        "    time.sleep(0.5)\\n"
        "    for p in sys.argv[2:]:\\n"
        "        try:\\n"
        "            open(p, 'w').write(json.dumps({{'forged': True}}))\\n"
        "        except OSError:\\n"
        "            pass\\n")
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                 start_new_session=True)
    subprocess.Popen([sys.executable, "-c", rewriter, MARK, *paths], **quiet)
    for _ in range(10):  # trick 3: ten sleepers in sessions of their own
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", MARK], **quiet)


def all_reduce_mean(tensor, group=None):  # wrong: it raises, naming whom it runs as
    raise ValueError(f"ran as uid {{os.getuid()}}")
'''


def _escapees(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mark.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def hostile_grading(tmp_path_factory):
    """Lab 00 graded through the command line, with an answer that is wrong and whose
    cell tries every trick at import."""
    import uuid

    tmp = tmp_path_factory.mktemp("hostile")
    tmp.chmod(0o755)
    mark = f"distlab-hostile-{uuid.uuid4().hex[:8]}"
    sentinel = tmp / "keep-me"
    sentinel.write_text("the grader's file")
    nb = nbformat.read(ROOT / "solutions" / "00_setup.ipynb", as_version=4)
    for cell in nb.cells:
        if notebook.grade_id(cell) == "all_reduce_mean":
            cell.source = _HOSTILE.format(mark=mark, sentinel=sentinel)
    path = tmp / "00_setup.ipynb"
    nbformat.write(nb, path)
    report = tmp / "grade.json"
    done = subprocess.run([sys.executable, "-m", "distlab.grade", str(path), "--json",
                           str(report)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    time.sleep(4)  # a rewriter that outlived the grader would have struck by now
    yield {"done": done, "report": report, "mark": mark, "sentinel": sentinel}
    for pid in _escapees(mark):  # never expected; keep the machine clean if it happens
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL) if pid > 1 else None
    for leftover in Path("/var/tmp").glob(f"{mark}-*"):  # graded ranks' /tmp is their own
        leftover.unlink()


class TestAHostileNotebook:
    """Three checks of one grading run (a unit of make test's workers: tests/durations.py)."""

    def test_a_forged_report_does_not_change_the_grade(self, hostile_grading):
        done = hostile_grading["done"]
        assert done.returncode == 0, done.stderr[-2000:]
        data = json.loads(hostile_grading["report"].read_text())
        (entry,) = data.values()
        r = entry["all_reduce_mean"]
        assert r["verdict"] in ("partial", "fail") and r["points"] < r["max"], r
        assert r["max"] >= 5, "the forged list of 50 passes did not become the maximum"


    def test_no_process_of_the_students_outlives_grading(self, hostile_grading):
        assert "forged" not in hostile_grading["report"].read_text(), "the JSON was rewritten"
        assert _escapees(hostile_grading["mark"]) == [], "students' processes outlived grading"


    @pytest.mark.skipif(os.geteuid() != 0, reason="only a root grader changes user")
    def test_students_code_runs_unprivileged_where_the_grader_is_root(self, hostile_grading):
        """The student's answer names its uid in the message it raises (a graded rank's /tmp
        and /var/tmp are its own, so no file of its reaches this process)."""
        (entry,) = json.loads(hostile_grading["report"].read_text()).values()
        message = entry["all_reduce_mean"]["message"]
        assert "ran as uid 65534" in message, f"the student's code did not run as nobody: {message}"
        assert hostile_grading["sentinel"].exists(), "the student's code deleted the grader's file"


@pytest.mark.parametrize("body, says", [
    ("import os\nos._exit(3)\n", "ended the process"),
    ("while True:\n    pass\n", "did not finish importing within 2 s")])
def test_an_exercise_that_breaks_at_import_keeps_its_points_in_the_maximum(
        tmp_path, monkeypatch, body, says):
    monkeypatch.setenv("DISTLAB_IMPORT_TIMEOUT", "2")
    path = _lab00_with(tmp_path, "    return tensor\n")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if notebook.grade_id(cell) == "all_reduce_mean":
            cell.source = body + cell.source
    nbformat.write(nb, path)
    (r,) = runner.grade(path)
    assert r.points == 0 and r.max_points >= 5, r
    assert says in r.message, r.message


def test_unreadable_notebooks_are_named_and_the_others_still_graded(tmp_path):
    broken = tmp_path / "broken.ipynb"
    broken.write_text("{ this is not json")
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "distlab.grade", "labs/00_setup.ipynb",
                          str(broken), str(tmp_path / "missing.ipynb"), "--json", str(report)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "is not a readable notebook" in out.stdout and "does not exist" in out.stdout
    data = json.loads(report.read_text())
    assert data["labs/00_setup.ipynb"]["all_reduce_mean"]["verdict"] == "not attempted"
    assert "error" in data[str(broken)]


def test_a_report_says_when_the_graded_code_ran_unconfined(monkeypatch):
    """Where the sandbox cannot be made here, the report says why and that its guarantees
    did not hold; where it was made, the report says nothing of it."""
    result = runner.Result("all_reduce_mean", 6, 6, "pass", "")
    monkeypatch.setattr(sandbox, "confinement", lambda: "unshare: Operation not permitted")
    lines = output.table([result]).splitlines()
    assert lines[-1].startswith("not confined: unshare: Operation not permitted; the graded "
                                "code ran without the sandbox"), lines
    monkeypatch.setattr(sandbox, "confinement", lambda: "")
    assert not any(line.startswith("not confined") for line in output.table([result]).splitlines())
