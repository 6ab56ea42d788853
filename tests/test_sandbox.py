"""The autograder's sandbox: containment of a process tree, the plain-data codec, the
student's module seen from outside, and the unprivileged user."""
import os
import sys
import uuid

import pytest
import torch

from distlab.runtime import plain
from distlab.grading import sandbox
from distlab.grading.student import Student
from distlab.runtime import privileges

_SPAWN = """
import subprocess, sys, time
for _ in range(3):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]],
                     start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("spawned", flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
"""


def _alive_with(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    data = f.read()
                with open(f"/proc/{entry}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if mark.encode() in data and not zombie:
                found.append(int(entry))
    return found


@pytest.mark.parametrize("mode", ["pidns", "subreaper"])
@pytest.mark.parametrize("ending", ["exit", "hang"])
def test_nothing_a_contained_command_started_outlives_it(monkeypatch, tmp_path, mode, ending):
    if mode == "pidns" and sandbox.containment() != "pidns":
        pytest.skip("no PID namespace here (needs root on Linux)")
    monkeypatch.setenv("DISTLAB_CONTAIN", mode)
    sandbox.containment.cache_clear()
    try:
        mark = f"distlab-contain-{uuid.uuid4().hex[:8]}"
        script = tmp_path / "spawn.py"
        script.write_text(_SPAWN)
        code, out = sandbox.run_contained([sys.executable, str(script), mark, ending],
                                          env=dict(os.environ), cwd=tmp_path,
                                          timeout=4 if ending == "hang" else 60)
    finally:
        sandbox.containment.cache_clear()
    assert "spawned" in out
    assert (code is None) == (ending == "hang"), (code, out)
    assert _alive_with(mark) == [], f"detached processes outlived the contained command ({mode})"


def test_plain_data_round_trips_and_nothing_else_travels():
    value = {"loss": 2.5, 3: [1, True, None, "x", b"\x00\xff"], "nan": float("nan"),
             "big": 2 ** 70, "t": (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                                   torch.zeros(0, 4), torch.tensor([True, False])),
             "dtype": torch.float16, "size": torch.Size([2, 3])}
    back = plain.loads(plain.dumps(value))
    assert back["loss"] == 2.5 and back[3] == [1, True, None, "x", b"\x00\xff"]
    assert back["nan"] != back["nan"] and back["big"] == 2 ** 70
    assert torch.equal(back["t"][0], value["t"][0]) and back["t"][0].dtype == torch.bfloat16
    assert back["t"][1].shape == (0, 4) and back["t"][2].tolist() == [True, False]
    assert back["dtype"] is torch.float16 and back["size"] == (2, 3)
    with pytest.raises(plain.PlainDataError, match="only None, bool"):
        plain.dumps({"fn": print})
    with pytest.raises(plain.PlainDataError, match="dict keys"):
        plain.dumps({(1, 2): 3})


@pytest.mark.parametrize("forged", [
    b"\x00" * 3, b"\xff" * 8 + b"{}", b"\x01\x00\x00\x00\x00\x00\x00\x00[",
    b"\x2b\x00\x00\x00\x00\x00\x00\x00" + b'{"tensor": ["float32", [4], 0, 16]}',
    b"\x1c\x00\x00\x00\x00\x00\x00\x00" + b'{"pickle": "cos\\nsystem\\n"}'])
def test_forged_plain_data_is_refused(forged):
    with pytest.raises(plain.PlainDataError):
        plain.loads(forged)


def test_the_students_module_is_read_not_run(tmp_path):
    module = tmp_path / "student.py"
    module.write_text("raise SystemExit('ran at import')\n\ndef f(x):\n    return x + 1\n"
                      "class Layer:\n    pass\nTABLE = 3\n")
    student = Student(module)
    assert student.names == {"f", "Layer", "TABLE"}
    assert repr(student.f) == "<the student's f>"
    with pytest.raises(AttributeError, match="defines no 'g'"):
        student.g


def test_a_direct_call_runs_sandboxed_and_raises_the_same_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_SANDBOX", "1")
    module = tmp_path / "student.py"
    module.write_text("import os\n\ndef pid(x):\n    return os.getpid(), x * 2\n\n"
                      "def picky(x):\n    raise ValueError(f'bad {x}')\n")
    student = Student(module)
    pid, doubled = student.pid(21)
    assert pid != os.getpid() and doubled == 42
    with pytest.raises(ValueError, match="bad 7"):
        student.picky(7)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root changes user")
def test_root_finds_an_unprivileged_user_that_can_still_import():
    user, why = privileges.unprivileged_user()
    assert user and user.split(":")[0] != "0", why


def test_scalar_tensors_travel_as_plain_data():
    for t in (torch.tensor(2.5), torch.tensor(3, dtype=torch.bfloat16), torch.tensor(True)):
        back = plain.loads(plain.dumps(t))
        assert back.shape == () and back.dtype == t.dtype and back.item() == t.item()


def test_a_probe_runs_its_check_in_a_child_and_says_what_it_raised():
    """privileges.probe: "" when the check returns, its exception when it raises, and what
    the check does to its process stays in the child."""
    assert privileges.probe(lambda: os.environ.__setitem__("DISTLAB_PROBED", "1")) == ""
    assert "DISTLAB_PROBED" not in os.environ
    assert privileges.probe(lambda: 1 / 0).startswith("ZeroDivisionError")


def test_the_fork_server_preloads_only_modules_of_the_fixed_list():
    """sandbox.preloads: of the modules an import line names (a ``from`` import: the
    package and each name that may be a submodule), only those of answers.PRELOADS;
    never another module of the kit (its ``__main__`` modules start benchmarks and
    launches), another package, a relative import, the exercise tests, or a line that
    does not parse. Every module of the library, named, is checked."""
    from pathlib import Path

    from distlab.grading import answers

    lines = ["import matplotlib.pyplot as plt", "from distlab import viz, comm",
             "import os, numpy", "import evil_package", "from . import sibling",
             "from distlab.grading import exercises", "import distlab.grading.exercises.ring_cases",
             "from torch.optim import *", "import matplotlib.pyplot", "def (", "x" + "+x" * 10**5,
             "import distlab.bench.__main__", "from distlab.acceptance import __main__"]
    assert sandbox.preloads(lines) == ["matplotlib.pyplot", "distlab", "distlab.viz",
                                       "distlab.comm", "numpy", "distlab.grading",
                                       "distlab.acceptance"]
    lib = Path(sandbox.__file__).resolve().parents[1]
    every = [".".join(("distlab", *p.relative_to(lib).with_suffix("").parts))
             for p in lib.rglob("*.py")]
    named = sandbox.preloads([f"import {m}" for m in every], ["distlab.train.__main__", "os"])
    assert set(named) <= answers.PRELOADS and not any("__main__" in m for m in named)
    assert sandbox.preloads([], ["torch._dynamo", "evil"]) == ["torch._dynamo"]


def test_a_fork_server_never_starts_a_launch(tmp_path):
    """A module the server imported that starts a launch (as ``distlab.bench.__main__``
    does) gets an error: servers never start servers."""
    import subprocess

    code = ("import os\nfrom distlab import launch\nfrom distlab.runtime import forkserver\n"
            "forkserver._SERVER = os.getpid()\n"
            "try:\n    launch.run(os.getpid, 1, backend='gloo', timeout=30)\n"
            "except Exception as exc:\n    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert "cannot start a launch" in out.stdout, out.stdout + out.stderr[-2000:]


def test_what_the_fork_server_may_preload_has_no_effect_at_import(tmp_path):
    """Every module of answers.PRELOADS (which holds all that the solutions' imports and
    the exercise tests' RANK_IMPORTS name), imported as the fork server does, starts no
    thread beyond those of torch's import (which the server has made before), writes no
    file and leaves CUDA uninitialised: a fork copies no thread, so a lock one held would
    be held forever in every rank, and a forked rank cannot use a CUDA its parent
    initialised."""
    import subprocess
    from pathlib import Path

    import nbformat

    from distlab.grading import labs, notebook

    from distlab.grading import answers

    root = Path(__file__).resolve().parents[1]
    lines = [line for nb in sorted((root / "solutions").glob("*.ipynb"))
             for line in notebook.imports(nbformat.read(nb, as_version=4))]
    declared = sorted({m for f in labs.TESTS.glob("test_*.py") for m in labs.rank_imports(f)})
    assert declared, "no exercise test declares RANK_IMPORTS"
    assert set(sandbox.preloads(lines, declared)) <= answers.PRELOADS
    names = sorted(answers.PRELOADS)
    assert "matplotlib.pyplot" in names and "torch._dynamo" in names, names
    code = ("import importlib, os, sys, torch\nprint(len(os.listdir('/proc/self/task')))\n"
            "for n in sys.argv[1:]:\n    try:\n        importlib.import_module(n)\n"
            "    except Exception:\n        pass\nprint(len(os.listdir('/proc/self/task')))\n"
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=dict(os.environ, MPLBACKEND="Agg"))
    assert out.returncode == 0, out.stderr
    torch_alone, after, cuda = out.stdout.split()[-3:]
    assert after == torch_alone, f"threads: {torch_alone} with torch, {after} after {names}"
    assert cuda == "False", f"importing {names} initialised CUDA"
    assert not os.listdir(tmp_path), f"importing {names} wrote {os.listdir(tmp_path)}"


_PID_PROBE = '''def all_reduce_mean(tensor, group=None):
    import os
    raise RuntimeError(f"PROBE pid={os.getpid()} uid={os.getuid()}")
'''


@pytest.mark.skipif(os.geteuid() != 0 or not __import__("shutil").which("setpriv"),
                    reason="needs root, to become another user, and setpriv")
def test_an_unprivileged_graders_ranks_are_confined(tmp_path):
    """A grader that is not root confines its ranks in a user namespace of their own:
    each is PID 1 of its namespace. (The fork server is non-dumpable; a rank must write
    its user namespace's ID maps all the same, and the probe that decides whether the
    sandbox can be made runs in the same state.)"""
    import subprocess
    from pathlib import Path

    import nbformat

    from distlab.grading import notebook

    root = Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "solutions" / "00_setup.ipynb", as_version=4)
    for cell in nb.cells:
        if notebook.grade_id(cell) == "all_reduce_mean":
            cell.source = _PID_PROBE
    tmp_path.chmod(0o755)
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    path.chmod(0o644)
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",  # reach the kit
         sys.executable, "-m", "distlab.grading", str(path)],
        capture_output=True, text=True, timeout=300, cwd=root,
        env=dict(os.environ, HOME=str(tmp_path)))
    found = [line for line in out.stdout.splitlines() if "PROBE pid=" in line]
    assert found, out.stdout[-3000:] + out.stderr[-3000:]
    assert all("PROBE pid=1 uid=65534" in line for line in found), found
