"""The grader against a student who cheats: each defect a probe found, defeated.

* the JSON report is never written through a link planted beside it (root follows none);
* the maximum comes from the kit's exercises of each lab, not from the notebook;
* the library's own answer to the exercise being graded refuses, however it is reached
  (called, re-loaded from its file, subclassed), and its source cannot be read;
* a stack file replaced by a FIFO cannot hang the launcher, and no exercise outlives
  its time limit, whatever hangs;
* control characters in what the student controls never reach the terminal raw;
* files the student's code leaves in /tmp or /dev/shm vanish with the grading run;
* a rank that allocates past its memory cap is reported "out of memory";
* a forged CommLog no longer earns traffic points where the bytes are counted on the
  run's own loopback (root, namespaces), and such points are marked self-reported where
  they are not;
* a graded rank holds of the grader's environment only an allow-list (an instructor's
  token is nowhere in its memory), writes no file past its cap and new files only on its
  own tmpfs, and opens no socket of a family but AF_UNIX, AF_INET, AF_INET6 (and
  NETLINK_ROUTE); personality and modify_ldt are refused.

Every grading run happens in a PID namespace of its own (as root), with a guard in each
Python process that refuses, and records, any signal to PID <= 1.
"""
import dataclasses
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from pid_guard import SITECUSTOMIZE as _GUARD

from distlab.grading import answers, labs, notebook, output, runner, sandbox, student
from distlab.runtime import cgroup

ROOT = Path(__file__).resolve().parents[1]
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="only a root grader changes user")


_DRIVER = """
import dataclasses, json, sys
from pathlib import Path
from distlab.grading import runner

args = json.loads(sys.argv[1])
results = runner.grade(Path(args["path"]), tests_dir=Path(args["tests"]), timeout=args["timeout"],
                       memory_mb=args["memory"], only=args["only"], total=args["total"])
print(json.dumps([dataclasses.asdict(r) for r in results]))
"""


def _grade(tmp_path, path: Path, tests: Path = runner.TESTS, timeout: float = 300,
           limit: float = 400, memory: int | None = None, only: list | None = None,
           total: float = runner.NOTEBOOK_TIMEOUT,
           extra_env: dict | None = None) -> tuple[dict, float]:
    """runner.grade in a PID namespace (as root) under the signal guard, with
    ``extra_env`` added to the grader's environment: exercise → its result as a dict,
    and the seconds it took."""
    guard = tmp_path / "guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(_GUARD)
    (tmp_path / "driver.py").write_text(_DRIVER)
    log = tmp_path / "signals.log"
    env = dict(os.environ, DISTLAB_GUARD_LOG=str(log), PYTHONPATH=os.pathsep.join(
        [str(guard)] + [p for p in sys.path if p]), **(extra_env or {}))
    cmd = [sys.executable, str(tmp_path / "driver.py"),
           json.dumps({"path": str(path), "tests": str(tests), "timeout": timeout,
                       "memory": memory, "only": only, "total": total})]
    if sandbox.containment() == "pidns":
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] + cmd
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    seconds = time.monotonic() - start
    assert not log.exists(), f"a signal to PID <= 1 was attempted:\n{log.read_text()}"
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["exercise"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}, seconds


def _notebook(tmp_path, lab: str, sources: dict[str, str], name: str | None = None,
              unmark: tuple = (), append: tuple = ()) -> Path:
    """Solution notebook ``lab`` with the cells of ``sources`` replaced, the nbgrader
    metadata of ``unmark`` removed, and the cells ``append`` ((lab, exercise) of other
    labs' solutions) added at the end."""
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    for cell in nb.cells:
        name_ = notebook.grade_id(cell)
        if name_ in sources:
            cell.source = sources[name_]
        if name_ in unmark:
            del cell.metadata["nbgrader"]
    for other, exercise in append:
        nb.cells += [c for c in nbformat.read(ROOT / "solutions" / f"{other}.ipynb",
                                              as_version=4).cells
                     if notebook.grade_id(c) == exercise]
    folder = tmp_path / "submission"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o755)
    path = folder / f"{name or lab}.ipynb"
    nbformat.write(nb, path)
    return path


def _tests(tmp_path, files: dict[str, str], conftest: bool = False) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in files.items():
        (tests / f"test_{name}.py").write_text(text)
    if conftest:
        (tests / "conftest.py").write_text((runner.TESTS / "conftest.py").read_text())
    return tests


# ------------------------------------------------------------- 1. the JSON report


def _main(*args: str) -> int:
    """The grader's command line, in a process of its own (it makes itself non-dumpable)."""
    return subprocess.run([sys.executable, "-m", "distlab.grading", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120).returncode


def test_the_json_report_never_follows_a_link_planted_beside_it(tmp_path):
    victim = tmp_path / "root-only"
    victim.write_text("the grader's secret")
    victim.chmod(0o600)
    nb = tmp_path / "99_not_a_lab.ipynb"  # refused at once: nothing is graded
    nbformat.write(nbformat.v4.new_notebook(), nb)
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    report = out / "report.json"
    (out / "report.json.tmp").symlink_to(victim)  # what the student's code planted
    assert _main(str(nb), "--json", str(report)) == 1  # an unknown lab
    assert victim.read_text() == "the grader's secret", "root wrote through the link"
    assert not report.is_symlink() and "is not one of the labs" in json.loads(
        report.read_text())[str(nb)]["error"]
    assert stat.S_IMODE(report.stat().st_mode) == 0o644

    shared = tmp_path / "shared"  # anyone may swap names in here
    shared.mkdir()
    shared.chmod(0o777)
    assert _main(str(nb), "--json", str(shared / "report.json")) == 2
    assert os.listdir(shared) == [], "nothing is written into a folder others can write"
    if os.geteuid() == 0:
        shared.chmod(0o1777)
        os.chown(shared, 65534, 65534)  # sticky, but another user's: refused too
        assert _main(str(nb), "--json", str(shared / "report.json")) == 2
        os.chown(shared, 0, 0)  # sticky and the grader's own (as /tmp): written
        assert _main(str(nb), "--json", str(shared / "report.json")) == 1
        assert os.listdir(shared) == ["report.json"]


# ------------------------------------------------- 2. the maximum comes from the kit


def test_the_kits_list_of_exercises_agrees_with_solutions_and_tests(tmp_path, monkeypatch):
    assert labs.problems(ROOT / "solutions") == []
    tests = tmp_path / "tests"  # the kit's tests, but zero2_step's lost
    tests.mkdir()
    for test in runner.TESTS.glob("test_*.py"):
        if test.name != "test_zero2_step.py":
            (tests / test.name).write_text(test.read_text())
    assert "zero2_step" not in labs.exercises(tests)["05_zero"]
    assert any("solutions/ has the exercise zero2_step" in p
               for p in labs.problems(ROOT / "solutions", tests))
    # a copy without it: deleting from the manifest itself would put it back last, and
    # the order of the labs' exercises, which is the manifest's, would change for the
    # tests run after this one in the same process
    monkeypatch.setattr(labs, "ANSWERS", {k: v for k, v in labs.ANSWERS.items()
                                          if k != "shard_range"})
    assert any("shard_range (05_zero) has no entry" in p
               for p in labs.problems(ROOT / "solutions"))
    every = labs.exercises()
    assert labs.lab_of("x/05_zero.ipynb", every) == labs.lab_of("05_zero-alice.ipynb", every) \
        == labs.lab_of("05_zero (1).ipynb", every) == "05_zero"
    assert labs.lab_of("05_zeroes.ipynb", every) is None
    assert labs.lab_of("zero.ipynb", every) is None


def test_a_notebook_is_graded_on_exactly_its_labs_exercises(tmp_path):
    """Lab 05 whose zero2_step cell lost its nbgrader metadata (it would fail), with lab
    00's exercise cell appended (its test would pass): 2/5, not 2/2 nor 3/3."""
    passing = "NOTEBOOK = '05_zero'\n\n\ndef test_one():\n    pass\n"
    tests = _tests(tmp_path, {"zero_bytes_per_rank": passing, "shard_range": passing,
                              "zero2_step": passing + "\n\ndef test_two():\n    pass\n\n\n"
                                            "def test_three():\n    pass\n",
                              "all_reduce_mean": passing.replace("05_zero", "00_setup")})
    path = _notebook(tmp_path, "05_zero", {}, unmark=("zero2_step",),
                     append=(("00_setup", "all_reduce_mean"),))
    results, _ = _grade(tmp_path, path, tests)
    assert [n for n, r in results.items() if r["verdict"] != "ignored"] == [
        "zero_bytes_per_rank", "shard_range", "zero2_step"]
    lost = results["zero2_step"]
    assert (lost["points"], lost["max_points"], lost["verdict"]) == (0, 3, "missing"), lost
    assert "the exercise cell for zero2_step is missing or lost its nbgrader metadata: " \
           "restore it from git" in lost["message"]
    foreign = results["all_reduce_mean"]
    assert (foreign["points"], foreign["max_points"], foreign["verdict"]) == (0, 0, "ignored")
    assert "belongs to 00_setup" in foreign["message"]
    assert sum(r["max_points"] for r in results.values()) == 5

    unknown = runner.grade(_notebook(tmp_path, "05_zero", {}, name="my_zero"), tests)
    assert [(r.points, r.max_points, r.verdict) for r in unknown] == [(0, 0, "error")]
    assert "my_zero.ipynb is not one of the labs" in unknown[0].message


# --------------------------------------------------- 3. the library's own answers

_CALLS = {  # lab 05's four exercises, each answered by the library in another way
    "zero_bytes_per_rank": (
        "from distlab.zero.memory import zero_bytes as _zb  # kept aside at import\n\n"
        "def zero_bytes_per_rank(*args, **kwargs):\n    return _zb(*args, **kwargs)\n"),
    "shard_range": (
        "def shard_range(*args):  # a fresh copy of the library's module, from its file\n"
        "    import importlib.util\n    import distlab.shards\n"
        "    spec = importlib.util.spec_from_file_location('mine', distlab.shards.__file__)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n    return module.shard_range(*args)\n"),
    "zero2_step": (
        "def zero2_step(*args, **kwargs):\n    import distlab.zero.step\n"
        "    return distlab.zero.step.zero2_step(*args, **kwargs)\n"),
    "ZeRO3Unit": (  # a fresh import of the module, in case the first was a stand-in
        "def ZeRO3Unit(*args, **kwargs):\n    import importlib\n    import distlab.zero.fsdp\n"
        "    return importlib.reload(distlab.zero.fsdp)._Unit(*args, **kwargs)\n"),
}
_CALL_TESTS = {
    "zero_bytes_per_rank": "def test_call(student):\n"
                           "    assert student.zero_bytes_per_rank(1e9, 4, 2) > 0\n",
    "shard_range": "def test_call(student):\n"
                   "    assert tuple(student.shard_range(10, 0, 2)) == (0, 5)\n",
    "zero2_step": "import torch\n\n\ndef test_call(student):\n"
                  "    student.zero2_step(torch.zeros(4), torch.ones(4), {}, lr=0.1)\n",
    "ZeRO3Unit": "def test_call(student):\n    assert student.ZeRO3Unit() is not None\n",
}


def test_calling_loading_or_reloading_the_librarys_answer_scores_zero(tmp_path):
    """Kept aside at import, loaded afresh from its file, called, reloaded and subclassed:
    the answers' modules are absent (stand-ins that refuse, no file), each scores 0."""
    tests = _tests(tmp_path, {name: "NOTEBOOK = '05_zero'\n" + text
                              for name, text in _CALL_TESTS.items()}, conftest=True)
    results, _ = _grade(tmp_path, _notebook(tmp_path, "05_zero", _CALLS), tests)
    for name in _CALLS:  # absent modules: no object to call, no file to load it from
        r = results[name]
        assert (r["points"], r["max_points"]) == (0, 1), r
        assert (r["verdict"], r["hint"]) == ("refused", ""), r
        assert r["message"].startswith(answers.REFUSAL), r


def test_subclassing_the_librarys_answer_scores_zero(tmp_path):
    path = _notebook(tmp_path, "08_overlap", {"BucketedDDP": (
        "from distlab.dp import DataParallel\n\n\n"
        "class BucketedDDP(DataParallel):\n    pass\n")})
    results, _ = _grade(tmp_path, path)
    r = results["BucketedDDP"]
    assert r["points"] == 0 and r["max_points"] >= 5, r
    assert "this is the library's answer to the exercise being graded" in r["message"], r


_UNWRAPPED = {  # the library's ps_sgd_step is decorated: reach the function it wraps
    "__wrapped__": (
        "import torch\nimport distlab.collectives.ps\n\n"
        "ps_sgd_step = torch.no_grad()(distlab.collectives.ps.ps_sgd_step.__wrapped__)\n"),
    "closure": (
        "import torch\nimport distlab.collectives.ps\n\n"
        "_inner = next(c.cell_contents for c in distlab.collectives.ps.ps_sgd_step.__closure__\n"
        "              if callable(c.cell_contents) and 'ps_sgd_step' in\n"
        "              getattr(c.cell_contents, '__qualname__', ''))\n"
        "ps_sgd_step = torch.no_grad()(_inner)\n"),
}


@pytest.mark.parametrize("route", sorted(_UNWRAPPED))
def test_an_answer_reached_through_its_decorator_scores_zero(tmp_path, route):
    """A decorator keeps the function it wraps (``__wrapped__``, and the wrapper's
    closure): the refusal reaches it too, whichever way a cell digs it out."""
    path = _notebook(tmp_path, "02_parameter_server", {"ps_sgd_step": _UNWRAPPED[route]})
    results, _ = _grade(tmp_path, path)
    r = results["ps_sgd_step"]
    assert (r["points"], r["verdict"]) == (0, "refused"), r
    assert r["max_points"] >= 7 and r["message"].startswith(answers.REFUSAL), r



# Rebuild an answer from whatever code object of it can be found in the rank: every
# function's code, every code object the collector knows, their nested constants, each
# through marshal (as a cell would carry it out of one process into another); a class
# from its methods' code. The cell binds every exercise of its lab to its rebuilt answer.
_REBUILD = """
import gc, marshal, sys, types
import torch
import torch.distributed as dist
from distlab.grading import answers as _answers

def _codes():
    stack = [o for o in gc.get_objects() if isinstance(o, types.CodeType)]
    stack += [o.__code__ for o in gc.get_objects() if isinstance(o, types.FunctionType)]
    for m in list(sys.modules.values()):
        stack += [v.__code__ for v in list(getattr(m, "__dict__", {}).values())
                  if isinstance(v, types.FunctionType)]
    seen = set()
    while stack:
        code = stack.pop()
        if id(code) not in seen:
            seen.add(id(code))
            yield code
            stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]

def _rebuild(exercise):
    scope = {"torch": torch, "dist": dist, "__builtins__": __builtins__}
    for ref in _answers.ANSWERS[exercise]:
        name = ref.split(":")[1]
        parts = {c.co_qualname: c for c in _codes() if c.co_qualname == name
                 or c.co_qualname.startswith(name + ".")}
        if name in parts:
            return types.FunctionType(marshal.loads(marshal.dumps(parts[name])), scope)
        if parts:
            return type(name, (torch.nn.Module,), {
                q.split(".")[-1]: types.FunctionType(marshal.loads(marshal.dumps(c)), scope)
                for q, c in parts.items()})
    raise LookupError(f"no code of {exercise}'s answer anywhere in this process")

def _bind(exercise):
    def answer(*args, **kwargs):
        return _rebuild(exercise)(*args, **kwargs)
    return answer

"""


def test_an_answer_rebuilt_from_any_code_object_in_the_rank_scores_zero(tmp_path):
    """Lab 05's shard_range and ZeRO3Unit (a function, and a class rebuilt from its
    methods) each bound to its answer rebuilt (``types.FunctionType`` on a marshalled code object) from any
    code the rank holds: none is there, all score 0. (That no exercise's answer code is
    anywhere in its ranks is the walk each solution's grading runs, tests/absence.py.)"""
    names = ("shard_range", "ZeRO3Unit")  # a function, and a class rebuilt from its methods
    cells = {name: _REBUILD + f"{name} = _bind({name!r})\n" for name in names}
    results, _ = _grade(tmp_path, _notebook(tmp_path, "05_zero", cells), only=list(names))
    for name in names:
        r = results[name]
        assert r["points"] == 0 < r["max_points"], r


def test_the_rebuild_works_where_the_answer_is_loaded():
    """The attack above is real: in a process that holds the library's answer, the cell's
    code rebuilds it from a marshalled code object and it runs."""
    import importlib

    importlib.import_module(answers.ANSWERS["shard_range"][0].split(":")[0])  # loaded, as
    scope: dict = {}  # disarming left it
    exec(_REBUILD, scope)
    assert scope["_bind"]("shard_range")(10, 1, 3) == (4, 7)


_PROBE = '''
import glob as _glob, os as _os, subprocess as _subprocess, sys as _sys

# At import, in every rank of both exercises: what an earlier exercise's ranks left in
# /tmp, /var/tmp or /dev/shm; then leave marks there; and in the first exercise's ranks, a
# detached process behind (the second's own ranks are alive while its test looks).
from distlab.grading import student as _student
_TAG = _os.path.basename(_os.environ.get("DISTLAB_DIR", "x"))
_CARRIED = [p for f in ("/tmp", "/var/tmp", "/dev/shm") for p in _glob.glob(f"{f}/MARK-*")
            if not p.endswith(_TAG)]
for _folder in ("/tmp", "/var/tmp", "/dev/shm"):
    try:
        with open(f"{_folder}/MARK-{_TAG}", "w") as _f:
            _f.write("left behind by a student")
    except OSError:
        pass
if _student._graded == ["ring_reduce_scatter"]:
    _subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(120)", "MARK"],
                      start_new_session=True, stdin=_subprocess.DEVNULL,
                      stdout=_subprocess.DEVNULL, stderr=_subprocess.DEVNULL)


def probe(paths, folder):
    import ctypes, linecache, mmap, os, signal, sys, time
    from distlab.runtime.confine import _CALLS
    import platform
    found = {"visible": [p for p in paths if os.path.exists(p)], "carried": _CARRIED}
    try:
        found["beside"] = sorted(os.listdir(folder))
    except OSError:
        found["beside"] = []
    with open("/proc/self/status") as f:
        found["caps"] = {k: v.strip() for k, v in (line.split(":", 1) for line in f)
                         if k.startswith("Cap")}
    libc = ctypes.CDLL(None, use_errno=True)
    calls = _CALLS[platform.machine()]
    found["calls"] = {}
    for name in ("open_by_handle_at", "name_to_handle_at", "ptrace", "process_vm_readv",
                 "pidfd_getfd", "unshare", "mount", "setns", "bpf", "io_uring_setup",
                 "syslog", "uselib"):
        ctypes.set_errno(0)
        arg = 0x10000000 if name == "unshare" else 0  # CLONE_NEWUSER
        code = libc.syscall(calls[name], ctypes.c_long(arg), ctypes.c_long(0),
                            ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0))
        found["calls"][name] = 0 if code >= 0 else ctypes.get_errno()
    found["linecache"] = [f for f in linecache.cache if "ring_cases" in f or "test_" in f]
    found["preloaded"] = "distlab.viz.fp8" in sys.modules  # the test's RANK_IMPORTS, by the server
    children = []
    for _ in range(400):  # processes: forked until refused
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    found["forked"] = len(children)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    written = 0
    try:  # tmpfs: /dev/shm filled until refused
        with open("/dev/shm/fill", "wb") as f:
            for _ in range(256):
                f.write(b"x" * 2**20)
                f.flush()
                written += 2**20
    except OSError:
        pass
    found["shm_mib"] = written >> 20
    try:  # a shared mapping of 1 GiB (not the process's data: only its address space caps it)
        m = mmap.mmap(-1, 2**30, flags=mmap.MAP_SHARED)
        m[::2**20] = b"x" * 1024
        found["shared_map"] = "held"
    except (OSError, ValueError, MemoryError) as exc:
        found["shared_map"] = type(exc).__name__
    return found
'''
_PROBE_TEST = '''

def _alive_with(mark):
    import os
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    found.append(entry)
        except OSError:
            pass
    return found


def test_the_sandbox_holds(student):
    import os, sys, time
    deadline = time.monotonic() + 5  # the first exercise's ranks were shut down just now
    while _alive_with("MARK") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive_with("MARK"), "a process of the first exercise outlived it"
    found = student.probe(PATHS, FOLDER)
    assert found["visible"] == [], f"visible to a rank: {found['visible']}"
    # beside the kit a rank may see the kit and the folders of what it is given (the run's
    # folder, the module, the path; all of them there when the checkout is in /tmp), and
    # the marks it left in its own /tmp: nothing else of what is beside the kit here
    given = [os.environ["DISTLAB_STUDENT"], os.environ["TMPDIR"], *filter(None, sys.path)]
    allowed = {os.path.basename(KIT)} | {
        os.path.relpath(g, FOLDER).split(os.sep)[0] for g in given
        if not os.path.relpath(g, FOLDER).startswith("..")}
    beside = [b for b in found["beside"] if b not in allowed and not b.startswith("MARK")]
    assert beside == [], f"beside the kit: {beside}"
    assert found["carried"] == [], f"carried from an earlier exercise: {found['carried']}"
    assert set(found["caps"].values()) == {"0000000000000000"}, found["caps"]
    refused = {n: e for n, e in found["calls"].items() if e != 1}  # 1: EPERM
    assert not refused, f"system calls not refused: {refused}"
    assert found["linecache"] == [], f"the tests' source reached the rank: {found['linecache']}"
    assert found["preloaded"], "the fork server did not import the test's RANK_IMPORTS"
    assert 0 < found["forked"] < PROCESSES, found["forked"]
    assert found["shm_mib"] <= TMPFS_MB, found["shm_mib"]
    assert found["shared_map"] != "held", "a 1 GiB shared mapping past the memory limit"
'''

# Lab 03's answers forged: gloo's all_reduce behind the tracer's back, and the sends of a
# ring (every chunk but its own, then every chunk but its successor's) logged by hand.
_FORGERS = '''

def _gloo_behind_the_tracer(flat, group):
    from distlab import comm as _comm
    _comm._state.depth += 1
    try:
        dist.all_reduce(flat, group=group)
    finally:
        _comm._state.depth -= 1


def _log_a_ring(tensor, group, skips):
    from distlab import comm as _comm
    K, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [c.numel() * c.element_size() for c in torch.tensor_split(tensor.reshape(-1), K)]
    for log in _comm._logs:
        log.events += [_comm.CommEvent(
            op="isend", nbytes=sizes[c], dtype=None, rank=rank, peer=(rank + 1) % K,
            group_size=K, group_ranks=tuple(range(K)), async_op=True, start=0.0, end=0.0)
            for skip in skips for c in range(K) if c != (rank + skip) % K]


def ring_reduce_scatter(tensor, group=None):
    full = tensor.reshape(-1).clone()
    _gloo_behind_the_tracer(full, group)
    _log_a_ring(tensor, group, (0,))
    return torch.tensor_split(full, dist.get_world_size(group))[dist.get_rank(group)].clone()


def ring_allreduce(tensor, group=None):
    _gloo_behind_the_tracer(tensor, group)
    _log_a_ring(tensor, group, (0, 1))
    return tensor
'''

# The kit's own checks of lab 03 (ring_cases.py), on 2 ranks: one launch per exercise.
_RING_TESTS = '''NOTEBOOK = "03_ring_allreduce"
NAME = "{name}"
MEMBERS = (0, 1)

from ring_cases import check_answers, check_traffic, check_wire, outcome


def test_sum(student):
    check_answers(NAME, outcome(student, NAME, MEMBERS, 2), MEMBERS, 2)


def test_ring_traffic(student):
    check_traffic(NAME, outcome(student, NAME, MEMBERS, 2), MEMBERS, 2)
    check_wire(NAME, MEMBERS, 2)
'''


@ROOT_ONLY
def test_a_graded_rank_is_confined_and_a_forged_commlog_earns_no_traffic_point(tmp_path):
    """One grading run of lab 03, two exercises, under a 512 MiB memory cap. In the ranks
    of both, the student's module plants files in /tmp, /var/tmp and /dev/shm; in the
    first's, it also leaves a detached process. The second exercise's test finds: no process of the first left,
    nothing carried over; absent from the rank's filesystem: solutions/, .git, the
    exercise tests, the kit's tests, the answer modules' source and any other checkout
    beside the kit; no capability; file handles, tracing, other processes' memory and
    descriptors, namespaces, mounts, BPF and io_uring refused (EPERM); no test source in
    the rank's linecache; the module the test declares in RANK_IMPORTS already imported; forks stop below the process limit, /dev/shm at its size, a
    1 GiB shared mapping fails. And the machine's /tmp, /var/tmp and /dev/shm hold none
    of the marks. Meanwhile the forgers all-reduce behind the tracer's back and log a
    ring's sends: ring_reduce_scatter's traffic point rests on the bytes counted on the
    run's own loopback, outside the ranks, and is lost (an all-reduce moves twice a ring
    reduce-scatter); ring_allreduce's cannot (gloo's all_reduce moves exactly a ring's
    bytes), and is kept, reported self-reported."""
    import uuid

    import distlab.zero.flat

    if sandbox.confinement():
        pytest.skip(f"graded ranks cannot be confined here: {sandbox.confinement()}")
    mark = f"distlab-left-{uuid.uuid4().hex[:8]}"
    paths = [str(p) for p in (ROOT / "solutions", ROOT / ".git", ROOT / "tests", runner.TESTS,
                              Path(distlab.zero.flat.__file__))]
    constants = (f"PATHS = {paths!r}\nKIT = {str(ROOT)!r}\nFOLDER = {str(ROOT.parent)!r}\n"
                 f"PROCESSES = {sandbox.PROCESSES}\nTMPFS_MB = {sandbox.TMPFS_MB}\n"
                 f"RANK_IMPORTS = ('distlab.viz.fp8',)\n")
    ring = _RING_TESTS.format(name="ring_allreduce")
    first = ring.index("\n\ndef test_sum")  # the probe's test first
    tests = _tests(tmp_path, {"ring_reduce_scatter": _RING_TESTS.format(name="ring_reduce_scatter"),
                              "ring_allreduce": ring[:first] + "\n" + constants
                              + _PROBE_TEST.replace("MARK", mark) + ring[first:]}, conftest=True)
    (tests / "ring_cases.py").write_text((runner.TESTS / "ring_cases.py").read_text())
    path = _notebook(tmp_path, "03_ring_allreduce",
                     {"ring_reduce_scatter": _FORGERS,
                      "ring_allreduce": _PROBE.replace("MARK", mark)})
    try:
        results, _ = _grade(tmp_path, path, tests, memory=512)
        left = [p for f in ("/tmp", "/var/tmp", "/dev/shm") for p in Path(f).glob(f"{mark}-*")]
    finally:
        for f in ("/tmp", "/var/tmp", "/dev/shm"):
            for p in Path(f).glob(f"{mark}-*"):
                p.unlink()
    assert left == [], f"the student's code left {left} on the machine"
    got = {name: (results[name]["points"], results[name]["max_points"],
                  results[name]["self_reported"])
           for name in ("ring_reduce_scatter", "ring_allreduce")}
    rs = results["ring_reduce_scatter"]
    assert results["ring_allreduce"]["points"] == 3, results["ring_allreduce"]["message"]
    if not sandbox.network_namespace():  # nothing counted: every traffic point self-reported
        assert got == {"ring_reduce_scatter": (2, 2, 1), "ring_allreduce": (3, 3, 1)}, results
        return
    assert got == {"ring_reduce_scatter": (1, 2, 0), "ring_allreduce": (3, 3, 1)}, results
    assert rs["message"].startswith("test_ring_traffic: ring_reduce_scatter, all cases on 2 "
                                    "ranks (a ring moves (K-1)/K of the buffer per rank): your "
                                    "ranks moved"), rs
    ratio = re.search(r"([\d.]+)x the [\d.]+ [KM]iB expected", rs["message"])
    assert ratio and 1.9 <= float(ratio[1]) <= 2.3, rs  # an all-reduce: twice a ring


# ------------------------------------------------ 4. FIFOs and the time limit


def _read_beside_a_fifo(fifo: str, read, what: str):
    """``read()``'s result, called in a thread; the test fails if it blocks (an open() stuck
    on the FIFO at ``fifo`` is then released by opening the FIFO's other end)."""
    got = []
    reader = threading.Thread(target=lambda: got.append(read()), daemon=True)
    reader.start()
    reader.join(15)
    if reader.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail(f"reading {what} blocked on a FIFO")
    return got[0]


def test_a_fifo_for_a_stack_file_cannot_hang_the_launcher(tmp_path):
    from distlab.runtime.pool import Pool

    class Rank:  # what _stacks uses of a rank; no process is signalled
        rank, stack_path = 0, str(tmp_path / "stack-0.txt")

        def signal(self, sig):
            pass

        def alive(self):
            return True

    os.mkfifo(Rank.stack_path)
    got = _read_beside_a_fifo(Rank.stack_path, lambda: Pool._stacks(None, [Rank()]),
                              "a rank's stack")
    assert "not a regular file" in got[0]


def test_a_fifo_or_a_link_for_a_status_file_cannot_hang_or_mislead_the_launcher(tmp_path):
    from distlab.runtime.pool import Pool

    class Rank:  # what _status uses of a rank
        rank, status_path = 0, str(tmp_path / "status-0")

    os.mkfifo(Rank.status_path)
    got = _read_beside_a_fifo(Rank.status_path, lambda: Pool._status(None, Rank()),
                              "a rank's status board")
    assert got == "unknown: its status file is not a regular file", got
    os.unlink(Rank.status_path)
    board = b"in all_reduce(4 B) since 1"
    board = b"\1\0\0\0" + board + b"\0" * (256 - 8 - len(board)) + b"\1\0\0\0"
    secret = tmp_path / "secret"
    secret.write_bytes(board)
    os.symlink(secret, Rank.status_path)  # a link is not followed: nothing read through it
    assert Pool._status(None, Rank()) == "starting"
    os.unlink(Rank.status_path)
    secret.rename(Rank.status_path)  # a regular file is read
    assert Pool._status(None, Rank()).startswith("waiting in all_reduce(4 B) for ")


def test_no_exercise_outlives_its_time_limit_whatever_hangs(tmp_path):
    """The tests of one exercise hang in the grader's own pytest process (as a launcher
    stuck on a FIFO did), beyond any budget the plugin checks: the grader stops them
    soon after the limit, and the next exercises are still graded."""
    passing = "NOTEBOOK = '05_zero'\n\n\ndef test_one():\n    pass\n"
    tests = _tests(tmp_path, {"zero_bytes_per_rank": "import time\n\nNOTEBOOK = '05_zero'\n\n\n"
                                                     "def test_hang():\n    time.sleep(3600)\n",
                              "shard_range": passing, "zero2_step": passing})
    results, seconds = _grade(tmp_path, _notebook(tmp_path, "05_zero", {}), tests, timeout=2)
    hung = results["zero_bytes_per_rank"]
    assert (hung["points"], hung["max_points"], hung["verdict"]) == (0, 1, "timeout"), hung
    assert "did not finish within 2 s" in hung["message"], hung
    assert [results[n]["verdict"] for n in ("shard_range", "zero2_step")] == ["pass", "pass"]
    assert seconds < 2 + 10 + 100, f"stopped after {seconds:.0f} s (the old grader: 135 s+)"


_HOG = '''
def all_reduce_mean(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    return tensor.div_(dist.get_world_size(group))


def hog():
    import torch
    return float(torch.ones(3 * 2**27).sum())  # 1.5 GiB
'''


def test_a_rank_past_its_memory_is_reported_out_of_memory(tmp_path):
    tests = _tests(tmp_path, {"all_reduce_mean": "NOTEBOOK = '00_setup'\n\n\n"
                                                 "def test_hog(student):\n"
                                                 "    assert student.hog() > 0\n"},
                   conftest=True)
    results, _ = _grade(tmp_path, _notebook(tmp_path, "00_setup", {"all_reduce_mean": _HOG}),
                        tests, memory=1024)
    r = results["all_reduce_mean"]
    assert (r["points"], r["max_points"], r["verdict"]) == (0, 1, "out of memory"), r["message"]
    assert "each graded rank may allocate 1024 MiB" in r["message"], r["message"]


_FORKS = '''
def all_reduce_mean(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    return tensor.div_(dist.get_world_size(group))


def held(children, mib):
    """Fork `children` that each take `mib` MiB and keep it: how many hold it at once,
    counted once every child has either said it holds its block or died."""
    import os, select, signal, time
    said = {}
    for _ in range(children):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            # each child maps all its parent does and `mib` more: the kernel's first
            # choice when the tree runs out of memory
            block = bytearray(mib << 20)
            block[::4096] = b"x" * len(block[::4096])
            os.write(w, b"1")
            time.sleep(300)
            os._exit(0)
        os.close(w)
        said[pid] = r
    holding, dead = set(), set()
    deadline = time.monotonic() + 120
    while len(holding | dead) < children and time.monotonic() < deadline:
        for pid, r in said.items():
            if pid not in holding | dead and select.select([r], [], [], 0)[0]:
                (holding if os.read(r, 1) else dead).add(pid)
        for pid in said:
            if pid not in dead and os.waitpid(pid, os.WNOHANG) != (0, 0):
                dead.add(pid)
        time.sleep(0.05)
    time.sleep(1)  # an allocation that just finished may still cost another its life
    for pid in said:
        if pid not in dead and os.waitpid(pid, os.WNOHANG) != (0, 0):
            dead.add(pid)  # reaped: never signalled below
    alive = holding - dead
    for pid in said:
        if pid > 1 and pid not in dead:  # ours, unreaped
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return len(alive)
'''


@pytest.mark.skipif(not cgroup.make_possible(), reason="no cgroup v1 memory and pids to write here")
def test_a_ranks_children_share_its_memory_cap(tmp_path):
    """--memory 256: a rank whose 8 children take 200 MiB each holds, together, no more
    than its cgroup allows (the cap plus cgroup.SLACK_MB): at most 3 of them live, where
    per-process limits let all 8 hold theirs (1.6 GiB)."""
    most = (256 + cgroup.SLACK_MB) // 200
    tests = _tests(tmp_path, {"all_reduce_mean": "NOTEBOOK = '00_setup'\n\n\n"
                                                 "def test_forks(student):\n"
                                                 f"    assert student.held(8, 200) <= {most}\n"},
                   conftest=True)
    results, _ = _grade(tmp_path, _notebook(tmp_path, "00_setup", {"all_reduce_mean": _FORKS}),
                        tests, memory=256)
    r = results["all_reduce_mean"]
    assert (r["points"], r["max_points"]) == (1, 1), r["message"]


# ---------------------------------------------------------- 5. the terminal


def test_control_characters_never_reach_the_terminal_raw():
    nasty = "wrong\x1b[2J\x1b[H\rtotal: 99/99\u202e\x07"
    shown = output.table([runner.Result("zero2_step", 0, 20, "fail", nasty)],
                         title="\nlabs/05_zero\x1b]0;owned\x07.ipynb")
    assert not any(ch in shown for ch in "\x1b\r\x07\u202e"), repr(shown)
    assert "\\x1b[2J" in shown and shown.endswith("total: 0/20")
    assert shown.count("\n") == 5  # the title's own line break, then header, rule, row, total
    assert json.loads(json.dumps(dataclasses.asdict(
        runner.Result("x", 0, 1, "fail", nasty))))["message"] == nasty  # the JSON is exact


# ------------------------------------ 6. traffic counted outside the ranks

_WIRE_SCRIPT = '''
import json, torch, torch.distributed as dist
from distlab import launch
from distlab.collectives.ring import ring_reduce_scatter
from distlab.grading import wire

N, W = 1 << 16, 2


def ring():
    ring_reduce_scatter(torch.ones(N))


def all_reduce():
    dist.all_reduce(torch.ones(N))


found = {"private": wire.private_loopback()}
with wire.measure(W) as honest:
    launch.run(ring, W)
with wire.measure(W) as cheat:
    launch.run(all_reduce, W)
wire.at_most(honest, (W - 1) * N * 4, "ring")
try:
    wire.at_most(cheat, (W - 1) * N * 4, "ring")
except AssertionError as exc:
    found["refused"] = str(exc)
found.update(honest=honest.payload, cheat=cheat.payload, allowance=cheat.allowance,
             gloo=wire.gloo_bytes("all_reduce", N * 4, W))
launch.shutdown()
print(json.dumps(found))
'''


@ROOT_ONLY
def test_the_loopback_counts_what_the_ranks_move(tmp_path):
    """In a network namespace of its own (as the grader's runs get it), lo's counters
    give a ring reduce-scatter's (n-1) buffers and gloo's all-reduce's 2(n-1), to within
    wire.TOLERANCE; a no-op launch on warm ranks costs nothing."""
    from distlab.grading import wire

    if not sandbox.network_namespace():
        pytest.skip("no network namespace here")
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(_GUARD)
    (tmp_path / "wire_probe.py").write_text(_WIRE_SCRIPT)
    log = tmp_path / "signals.log"
    env = dict(os.environ, DISTLAB_GUARD_LOG=str(log), PYTHONPATH=os.pathsep.join(
        [str(guard)] + [p for p in sys.path if p]))
    done = subprocess.run(sandbox._UNSHARE + ["--net", sys.executable, "-m",
                                              "distlab.grading.sandbox", "init", "--",
                                              sys.executable, str(tmp_path / "wire_probe.py")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert not log.exists(), log.read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    ring = 1 << 18  # (n-1) buffers of 256 KiB
    assert found["private"] and found["allowance"] == 0, found
    assert ring - 1024 <= found["honest"] <= ring * (1 + wire.TOLERANCE), found
    assert found["gloo"] <= found["cheat"] <= found["gloo"] * (1 + wire.TOLERANCE), found
    assert "x the 256.0 KiB expected" in found["refused"], found


def test_without_a_private_loopback_nothing_is_counted(monkeypatch):
    """Outside a grader's network namespace (here, the machine's own network, even with
    the variable set) the bytes are not counted, and a wire check checks nothing."""
    from distlab.grading import wire

    monkeypatch.setenv(wire.ENV, "lo")
    if set(wire.interfaces() or {}) == {"lo"}:
        pytest.skip("this test process already sits in a loopback-only namespace")
    assert not wire.private_loopback()
    with wire.measure(2) as reading:
        pass
    assert reading.payload is None
    wire.at_most(reading, 0, "nothing")  # not counted: no verdict from the wire
    assert wire.checks_made()[1] >= 1, "a wire check with nothing counted is recorded"
    assert wire.evidence_of(True, False) == wire.evidence_of(False, False, True) == \
        "self-reported"
    assert wire.evidence_of(True, True) == "wire" and wire.evidence_of(False, False) == ""


# ------------------------------------- 7. files root makes, notebooks root reads


def test_root_never_acts_on_a_link_planted_in_a_rank_folder(tmp_path):
    """A status board is created, never opened: an entry already there (a link to a file
    only root may touch, planted by a process of an earlier launch) is refused, and the
    target keeps its content, mode and owner."""
    from distlab.runtime.rankproc import create_board

    victim = tmp_path / "root-only"
    victim.write_text("the grader's secret")
    victim.chmod(0o600)
    before = victim.stat()
    (tmp_path / "status-0").symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_board(str(tmp_path / "status-0"), (65534, 65534))
    after = victim.stat()
    assert victim.read_text() == "the grader's secret"
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
    create_board(str(tmp_path / "status-1"), (65534, 65534) if os.geteuid() == 0 else None)
    made = os.lstat(tmp_path / "status-1")
    assert stat.S_ISREG(made.st_mode) and made.st_size == 256
    assert made.st_uid == (65534 if os.geteuid() == 0 else os.geteuid())


def test_a_notebook_is_read_as_a_plain_file_of_bounded_size(tmp_path):
    """Links (to a file the student cannot read), FIFOs, hard links and a 2 GiB sparse
    file are refused before anything is parsed; no message quotes the content."""
    secret = tmp_path / "secret.ipynb"
    secret.write_text("SECRET-ANSWER {not json")
    secret.chmod(0o600)
    cases = {"link": (tmp_path / "05_zero-link.ipynb", "is a symbolic link"),
             "fifo": (tmp_path / "05_zero-fifo.ipynb", "not a regular file"),
             "hard": (tmp_path / "05_zero-hard.ipynb", "other names (hard links)"),
             "big": (tmp_path / "05_zero-big.ipynb", "larger than 64 MiB"),
             "junk": (tmp_path / "05_zero-junk.ipynb", "not a readable notebook")}
    cases["link"][0].symlink_to(secret)
    os.mkfifo(cases["fifo"][0])
    os.link(secret, cases["hard"][0])
    with open(cases["big"][0], "wb") as f:
        f.truncate(2 << 30)
    cases["junk"][0].write_text("SECRET-ANSWER {not json")
    for what, (path, why) in cases.items():
        with pytest.raises(notebook.SubmissionError) as caught:
            notebook.read_submission(path)
        assert why in str(caught.value) and "SECRET" not in str(caught.value), (what, caught.value)
    good = tmp_path / "05_zero.ipynb"
    good.write_bytes((ROOT / "labs" / "05_zero.ipynb").read_bytes())
    assert notebook.exercises(notebook.read_submission(good))


def test_a_batch_goes_on_past_a_notebook_that_cannot_be_graded(tmp_path):
    """Three submissions on one command line: a 2 GiB sparse file and a link are refused
    with an error entry each; a notebook with a 100,000-term expression (an AST deeper
    than the parser's stack) is graded; the JSON holds all three."""
    folder = tmp_path / "in"
    folder.mkdir()
    deep = nbformat.read(ROOT / "labs" / "00_setup.ipynb", as_version=4)
    deep.cells.append(nbformat.v4.new_code_cell("x = " + "+".join(["1"] * 100_000)))
    nbformat.write(deep, folder / "00_setup-deep.ipynb")
    with open(folder / "00_setup-big.ipynb", "wb") as f:
        f.truncate(2 << 30)
    (folder / "00_setup-link.ipynb").symlink_to(folder / "00_setup-deep.ipynb")
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    names = ["00_setup-big.ipynb", "00_setup-link.ipynb", "00_setup-deep.ipynb"]
    done = subprocess.run([sys.executable, "-m", "distlab.grading", *(str(folder / n) for n in names),
                           "--json", str(out / "r.json")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # two refused
    report = json.loads((out / "r.json").read_text())
    assert "larger than 64 MiB" in report[str(folder / names[0])]["error"]
    assert "symbolic link" in report[str(folder / names[1])]["error"]
    assert report[str(folder / names[2])]["all_reduce_mean"]["verdict"] == "not attempted"


def test_a_deep_ast_compiles_to_a_stub(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import os"))
    nb.cells.append(nbformat.v4.new_code_cell("import sys\ny = " + "+".join(["1"] * 100_000)))
    cell = nbformat.v4.new_code_cell("def f():\n    return " + "+".join(["1"] * 100_000))
    cell.metadata["nbgrader"] = {"solution": True, "grade_id": "f"}
    nb.cells.append(cell)
    source = notebook.module_source(nb)
    assert "import os" in source and "does not compile" in source
    assert student._defined_names("x = " + "(" * 100_000) == set()


# ------------------------------------------------------- 8. plain data only


class _Pickled:
    """Unpickling it creates a file: the proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_fork_server_unpickles_nothing(tmp_path):
    """Both ends of the fork server's socket (which a rank of the same user might reach)
    decode plain data only: a pickle sent to the server, or answered to the launcher,
    runs nothing."""
    import pickle
    import socket

    from distlab.runtime import forkserver, plain

    mark = tmp_path / "unpickled"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.send(pickle.dumps((1, ("spawn", _Pickled(str(mark))))))
    assert forkserver._serve(theirs, set()) is False
    assert not mark.exists(), "the fork server unpickled a request"

    class Proc:  # what the launcher's side uses of the server's process
        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    server = object.__new__(forkserver.ForkServer)
    server.sock, server.lock, server.broken, server.proc = ours, threading.Lock(), False, Proc()
    server.ids = iter(range(1, 10))
    theirs.send(pickle.dumps((1, ("status", _Pickled(str(mark))))))
    assert server.reap(1234) == -9  # the answer is refused, the server discarded
    assert not mark.exists() and server.broken, "the launcher unpickled a reply"
    theirs.close()
    assert plain.loads(plain.dumps((1, ("spawn", {"A": "b"})))) == (1, ("spawn", {"A": "b"}))


# --------------------------------------------------------------- 9. limits


def test_output_is_cut_with_a_marker(monkeypatch, capfd):
    """A sandboxed launch keeps at most 1 MiB of a rank's output per launch, and the
    grader the last 4 MiB of a run's, each saying how much it cut."""
    from distlab import launch

    tail = sandbox._Tail()
    for _ in range(10):
        tail.add(b"x" * 2**20)
    text = tail.text()
    assert text.startswith("[… 6.0 MiB cut]") and len(text) < sandbox.OUTPUT_KEPT + 2**20
    monkeypatch.setenv("DISTLAB_SANDBOX", "1")
    monkeypatch.delenv("DISTLAB_SANDBOX_USER", raising=False)
    try:
        launch.run(_shout, 1, backend="gloo", timeout=60)
    finally:
        launch.shutdown()
    out = capfd.readouterr().out
    assert "MiB cut]" in out and len(out) < 2 * 2**20, len(out)


def _shout():
    import sys
    for _ in range(6):
        sys.stdout.write("y" * 2**20)
    sys.stdout.flush()


def test_a_notebook_has_a_total_time(tmp_path):
    """Exercises that each stay within their own limit cannot together hold the grader
    past the notebook's: what is left when it runs out counts as timed out."""
    slow = "import time\n\nNOTEBOOK = '05_zero'\n\n\ndef test_slow():\n    time.sleep(3600)\n"
    tests = _tests(tmp_path, {name: slow for name in ("zero_bytes_per_rank", "shard_range",
                                                      "zero2_step")})
    results, seconds = _grade(tmp_path, _notebook(tmp_path, "05_zero", {}), tests, timeout=300,
                              total=8)
    mine = [results[n] for n in ("zero_bytes_per_rank", "shard_range", "zero2_step")]
    assert [(r["points"], r["verdict"]) for r in mine] == [(0, "timeout")] * 3, mine
    assert all("used its 8 s" in r["message"] for r in mine), mine
    assert seconds < 8 + 100, f"stopped after {seconds:.0f} s"


def test_the_data_behind_an_absent_answer_is_absent_and_the_library_still_imports():
    """With bus_bandwidth's answers absent (as in its graded ranks), the private table only
    the answer reads is not there either (a stand-in that refuses), and the library that
    imports the answer module (distlab.comm) still imports and runs."""
    probe = ("from distlab.grading import answers; from distlab.runtime import absent\n"
             "absent.install(answers.modules_of(['bus_bandwidth']), answers.REFUSAL)\n"
             "from distlab import comm; import distlab.collectives.bandwidth as c\n"
             "print(type(c).__name__, comm.CommLog.__name__)\n"
             "try:\n    c._BUS_FACTORS['all_reduce']\nexcept RuntimeError as e:\n"
             "    print('refused' if answers.REFUSAL in str(e) else e)\n"
             "import importlib; importlib.reload(c); print(type(c).__name__)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AbsentModule", "CommLog", "refused", "AbsentModule"], \
        done.stdout

_GPIPE_BY_REFERENCE = (
    "def gpipe_schedule(num_stages, num_microbatches):\n"
    "    from distlab import pp\n"
    "    return pp.gpipe_schedule(num_stages, num_microbatches)\n")


def test_calling_the_reference_schedule_scores_zero_and_points_at_no_hint(tmp_path):
    path = _notebook(tmp_path, "07_pipeline_parallel", {"gpipe_schedule": _GPIPE_BY_REFERENCE})
    results, _ = _grade(tmp_path, path, only=["gpipe_schedule"])
    r = results["gpipe_schedule"]
    assert (r["points"], r["verdict"], r["hint"]) == (0, "refused", ""), r
    assert r["max_points"] >= 12 and r["message"].endswith("write your own"), r


# ------------- 10. what a rank reaches: the grader's environment, the disk, the kernel

_CANARY = "canary-of-the-graders-environment-5c1e"  # never in the graded run: only reversed

# The student's module: lab 00's answer, and a probe that runs in a graded rank.
_ESCAPES = r'''
def all_reduce_mean(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    return tensor.div_(dist.get_world_size(group))


def escapes(backwards, cap_mb):
    import ctypes, errno, os, platform, resource, socket, tempfile
    libc = ctypes.CDLL(None, use_errno=True)
    found = {"environ": dict(os.environ)}

    # the grader's environment: the canary's value, put together here in a buffer of our
    # own (never as a string), is looked for in every writable mapping of this process
    n = len(backwards)
    needle = ctypes.create_string_buffer(n)
    for i, c in enumerate(backwards.encode()):
        ctypes.memset(ctypes.addressof(needle) + n - 1 - i, c, 1)
    libc.memmem.restype = ctypes.c_void_p
    libc.memmem.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    found["canary_in"], found["scanned_mib"] = [], 0
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    for r in regions:
        name = r[5] if len(r) > 5 else "anonymous"
        if not r[1].startswith("rw") or name.startswith(("[v", "/dev/")):
            continue
        lo, hi = (int(x, 16) for x in r[0].split("-"))
        found["scanned_mib"] += (hi - lo) >> 20
        at = lo
        while at < hi:
            hit = libc.memmem(at, hi - at, ctypes.addressof(needle), n)
            if not hit:
                break
            if hit != ctypes.addressof(needle):
                found["canary_in"].append(name)
            at = hit + 1
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self is then this user's to read
    try:
        with open("/proc/self/environ", "rb") as f:
            found["proc_environ"] = f.read().replace(b"\0", b"").decode(errors="replace")
    except OSError as exc:
        found["proc_environ"] = f"unreadable: {exc}"

    # the disk: a new file in every folder a rank knows of, and every mount point,
    # written until refused; each file of the pool's folder grown past the cap
    found["fsize"] = list(resource.getrlimit(resource.RLIMIT_FSIZE))
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    folder = os.environ.get("DISTLAB_DIR", "")
    places = sorted({*points, folder, os.getcwd(), os.path.expanduser("~"),
                     tempfile.gettempdir(), "/", "/tmp", "/var/tmp", "/dev/shm"} - {""})
    found["written"], chunk = {}, b"x" * 2**20
    for place in places:
        path = os.path.join(place, f"escape-{os.getpid()}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            continue
        size, written = 0, 0
        try:
            st = os.statvfs(place)
            size = st.f_blocks * st.f_frsize
            for _ in range(cap_mb + 2):
                written += os.write(fd, chunk)
        except OSError:
            pass
        finally:
            os.close(fd)
            os.unlink(path)
        found["written"][place] = [written, size]
    found["grown"] = {}
    for name in sorted(os.listdir(folder)) if folder else ():
        try:
            fd = os.open(os.path.join(folder, name), os.O_WRONLY)
        except OSError:
            continue
        try:
            os.pwrite(fd, b"x", cap_mb << 20)  # one byte past the cap
            found["grown"][name] = "grown"
        except OSError as exc:
            found["grown"][name] = errno.errorcode.get(exc.errno, str(exc.errno))
        finally:
            os.close(fd)

    # the kernel: every socket family, netlink's protocols, personality, modify_ldt
    def outcome(call, *args):
        try:
            made = call(*args)
            for s in made if isinstance(made, tuple) else (made,):
                s.close()
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))

    found["socket"] = {f"{family} {kind}": outcome(socket.socket, family, kind, 0)
                       for family in range(64) for kind in (1, 2, 3, 5)}
    found["netlink"] = {str(proto): outcome(socket.socket, 16, 3, proto) for proto in range(32)}
    found["socketpair"] = {str(family): outcome(socket.socketpair, family, 1, 0)
                           for family in range(64)}
    calls = {"x86_64": (135, 154), "aarch64": (92, None)}[platform.machine()]
    found["personality"] = {}
    for persona in (0xFFFFFFFF, 0, 0x0040000, 0x0400000):  # query, linux, no ASLR, exec
        ctypes.set_errno(0)
        got = libc.syscall(calls[0], ctypes.c_ulong(persona))
        found["personality"][hex(persona)] = "ok" if got >= 0 else errno.errorcode[ctypes.get_errno()]
    if calls[1]:
        table = ctypes.create_string_buffer(64)
        ctypes.set_errno(0)
        got = libc.syscall(calls[1], 0, table, 64)  # read the LDT
        found["modify_ldt"] = "ok" if got >= 0 else errno.errorcode[ctypes.get_errno()]
    return found
'''


@pytest.fixture(scope="module")
def escapes(tmp_path_factory):
    """One grading run of lab 00 with a canary in the grader's environment, in which the
    student's module probes, from a graded rank, its environment and memory, every
    place it could write, and the socket families and system calls of the grader's
    issue (rows 5, 8 and 9); what it found, and the run's results."""
    if sandbox.confinement():
        pytest.skip(f"graded ranks cannot be confined here: {sandbox.confinement()}")
    tmp_path = tmp_path_factory.mktemp("escapes")
    out = tmp_path / "found.json"
    test = ("import json\n\nNOTEBOOK = '00_setup'\n\n\ndef test_escapes(student):\n"
            f"    found = student.escapes({_CANARY[::-1]!r}, {sandbox.FSIZE_MB})\n"
            f"    open({str(out)!r}, 'w').write(json.dumps(found))\n")
    tests = _tests(tmp_path, {"all_reduce_mean": test}, conftest=True)
    results, _ = _grade(tmp_path, _notebook(tmp_path, "00_setup", {"all_reduce_mean": _ESCAPES}),
                        tests, extra_env={"INSTRUCTOR_TOKEN": _CANARY})
    r = results["all_reduce_mean"]
    assert r["verdict"] == "pass", r["message"]
    return json.loads(out.read_text())


# what the launcher sets in a graded rank's environment, beside confine.RANK_ENV's
_LAUNCH_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DISTLAB_WORKER",
               "DISTLAB_BACKEND", "DISTLAB_DIR", "DISTLAB_PLAIN", "DISTLAB_FD",
               "DISTLAB_PARENT_PID", "DISTLAB_GRADE_MEMORY_MB", "HOME", "TMPDIR"}


def test_no_variable_of_the_graders_environment_outside_the_allow_list_reaches_a_rank(escapes):
    """Row 8. A graded rank's environment holds the launch's variables and, of the
    grader's, only what confine.RANK_ENV allows: not the sandbox's spec, not the
    grader's paths (HOME and TMPDIR are the rank's own /tmp); /proc/self/environ (the
    environment its process was started with, inherited through the forks) is empty; and
    a variable outside the allow-list (an instructor's token) is nowhere in the rank's
    memory, since no process it is forked from ever held it."""
    import fnmatch

    from distlab.runtime import confine

    env = escapes["environ"]
    stray = sorted(k for k in env if k not in _LAUNCH_ENV and not any(
        fnmatch.fnmatchcase(k, p) for p in confine.RANK_ENV))
    assert stray == [], f"of the grader's environment, reached a rank: {stray}"
    assert (env["HOME"], env["TMPDIR"]) == ("/tmp", "/tmp"), env
    assert escapes["proc_environ"] == "", escapes["proc_environ"][:2000]
    assert escapes["scanned_mib"] > 0 and escapes["canary_in"] == [], escapes["canary_in"]


def test_a_rank_cannot_write_more_than_the_cap_anywhere_it_can_write(escapes):
    """Row 5. RLIMIT_FSIZE caps every file a graded rank writes (sandbox.FSIZE_MB, soft and
    hard); a new file can be made only on the rank's own tmpfs (none larger than
    sandbox.TMPFS_MB), in every mount point and every folder the rank knows of (the
    pool's folder, its HOME, TMPDIR and working folder) alike; and none of the pool's
    files it may write (its status board, stack dumps, the rendezvous store, on the
    host's disk) grows past the cap."""
    cap = sandbox.FSIZE_MB << 20
    assert escapes["fsize"] == [cap, cap], escapes["fsize"]
    assert escapes["written"], "the rank could write nowhere, not even in its /tmp"
    uncapped = {place: got for place, got in escapes["written"].items()
                if got[0] > cap or got[1] > sandbox.TMPFS_MB << 20}
    assert uncapped == {}, f"written (bytes, size of the storage): {uncapped}"
    assert escapes["grown"] and set(escapes["grown"].values()) == {"EFBIG"}, escapes["grown"]


def test_every_socket_family_outside_the_allowed_set_fails_and_personality_is_refused(escapes):
    """Row 9. In a graded rank, a socket of any family but AF_UNIX, AF_INET and AF_INET6
    fails with EAFNOSUPPORT (AF_VSOCK, AF_PACKET, AF_NETLINK's protocols, ...), but for
    AF_NETLINK with NETLINK_ROUTE (getifaddrs: the run's gloo found its interface
    through it); socketpair likewise; personality changes nothing (its query answers);
    modify_ldt is refused (x86-64)."""
    allowed = {1, 2, 10}
    opened = {k: v for k, v in escapes["socket"].items()  # (protocol 0: AF_NETLINK's is
              if int(k.split()[0]) not in allowed | {16} and v != "EAFNOSUPPORT"}  # below)
    assert opened == {}, f"socket(family, type) outside AF_UNIX/INET/INET6: {opened}"
    assert escapes["netlink"].pop("0") == "ok", "NETLINK_ROUTE (gloo's getifaddrs) refused"
    assert set(escapes["netlink"].values()) == {"EAFNOSUPPORT"}, escapes["netlink"]
    paired = {k: v for k, v in escapes["socketpair"].items()
              if int(k) not in allowed and v != "EAFNOSUPPORT"}
    assert paired == {} and escapes["socketpair"]["1"] == "ok", escapes["socketpair"]
    assert escapes["personality"] == {"0xffffffff": "ok", "0x0": "EPERM", "0x40000": "EPERM",
                                      "0x400000": "EPERM"}, escapes["personality"]
    assert escapes.get("modify_ldt", "EPERM") == "EPERM", escapes["modify_ldt"]


def _filtered(program: bytes, arch: str, nr: int, *args: int) -> int:
    """The action ``program`` (a seccomp filter) returns for call ``nr`` with ``args`` on
    ``arch``: a classic-BPF machine of the instructions confine.seccomp_program uses."""
    import struct

    from distlab.runtime import confine

    ops = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    data = struct.pack("<iIQ6Q", nr, confine._AUDIT_ARCH[arch], 0,
                       *(list(args) + [0] * 6)[:6])
    a = pc = 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x06:  # ret
            return k
        if code == 0x20:  # ld [k]
            a, pc = struct.unpack_from("<I", data, k)[0], pc + 1
            continue
        hit = {0x15: a == k, 0x35: a >= k, 0x45: bool(a & k)}[code]
        pc += 1 + (jt if hit else jf)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_filter_screens_socket_families_and_personality_on_both_architectures(arch):
    """Row 9, on both architectures the filter supports (aarch64 run through a BPF
    machine here): socket and socketpair of a family outside AF_UNIX, AF_INET, AF_INET6
    answer EAFNOSUPPORT, AF_NETLINK only with NETLINK_ROUTE (the low 32 bits compared,
    as the kernel reads an int); personality answers only its query; modify_ldt
    (x86-64) and every other DENIED call answer EPERM; an ordinary call is allowed."""
    from distlab.runtime import confine

    program, calls = confine.seccomp_program(arch), confine._CALLS[arch]
    allow, eperm, eafnosupport = 0x7FFF0000, 0x50001, 0x50061
    for family in range(64):
        for high in (0, 1 << 32):
            expected = allow if family in (1, 2, 10) else eafnosupport
            assert _filtered(program, arch, calls["socketpair"], family | high, 1) == expected
            if family == 16:
                for proto in range(32):
                    assert _filtered(program, arch, calls["socket"], family | high, 3,
                                     proto | high) == (allow if proto == 0 else eafnosupport)
            else:
                assert _filtered(program, arch, calls["socket"], family | high, 1) == expected
    for persona, expected in ((0xFFFFFFFF, allow), (0, eperm), (0x0040000, eperm),
                              (0x0400000, eperm), (0xFFFFFFFF | 1 << 32, allow)):
        assert _filtered(program, arch, calls["personality"], persona) == expected, hex(persona)
    assert ("modify_ldt" in calls) == (arch == "x86_64") and "modify_ldt" in confine.DENIED
    for name in confine.DENIED:
        if name in calls:
            assert _filtered(program, arch, calls[name]) == eperm, name
    read = {"x86_64": 0, "aarch64": 63}[arch]
    assert _filtered(program, arch, read, 3) == allow
