"""Untrusted code in the autograder: where a student's code runs, as whom, and how it ends.

A student's notebook can run anything when it is imported, so the grade must never
depend on a process that ran it. The mechanism: each graded rank runs in the sandbox of
:mod:`distlab.runtime.confine` — namespaces, a root built from what it may read (the
kit's checkout, ``solutions/``, the exercise tests and the answer modules absent), a user
namespace with no capability, a seccomp filter, capped tmpfs, a process limit — made by
kernel calls in the freshly forked rank, because ranks come warm from the fork server
(bubblewrap would start a fresh interpreter: seconds of importing torch per rank, where
this costs milliseconds; Landlock restricts paths but neither hides them nor drops the
capabilities, and libseccomp's binding is not installable everywhere, so the filter is
built by hand). :func:`confinement` probes once whether it can be made here; where it
cannot (macOS, a container forbidding namespaces) the guarantees marked *sandbox* are
lost and the others hold. docs/design.md, "What the grader guarantees", states each
guarantee and what it rests on; README.md's table names the test of each.
"""
from __future__ import annotations

import ast
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from distlab.grading import answers
from distlab.runtime import cgroup
from distlab.runtime.privileges import PR_SET_CHILD_SUBREAPER, prctl

# ------------------------------------------------------------ containing a process tree


@functools.lru_cache(maxsize=None)
def containment() -> str:
    """"pidns" where a new PID namespace can be made (root, Linux), else "subreaper"
    (Linux) or "group" (elsewhere: only the process group is killed)."""
    forced = os.environ.get("DISTLAB_CONTAIN")
    if forced in ("pidns", "subreaper", "group"):
        return forced
    if sys.platform != "linux":
        return "group"
    if os.geteuid() == 0:
        try:
            ok = subprocess.run(_UNSHARE + ["true"], capture_output=True, timeout=30)
            if ok.returncode == 0:
                return "pidns"
        except (OSError, subprocess.SubprocessError):
            pass
    return "subreaper"


_UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


@functools.lru_cache(maxsize=None)
def network_namespace() -> bool:
    """Whether contained runs also get a network namespace of their own (namespaces, and
    in a fresh one made by ``unshare --net``, ``lo`` comes up: without it gloo's ranks
    could not reach each other): the condition for traffic counted outside the ranks."""
    if containment() != "pidns":
        return False
    probe = "from distlab.grading import wire; raise SystemExit(0 if wire.loopback_up() else 1)"
    try:
        return subprocess.run(["unshare", "--net", sys.executable, "-c", probe],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# What a grading run's processes hold of the grader's environment (fnmatch patterns): what
# its ranks may hold (distlab.runtime.confine.RANK_ENV), the kit's own settings
# (DISTLAB_*), and where Python finds the kit. The ranks are forked from the run's pytest,
# so a variable it never held (an instructor's token) is nowhere in a rank's memory.
RUN_ENV = ("DISTLAB_*", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "HOME")


def run_environment(env=None) -> dict:
    """The variables of ``env`` (the grader's environment) that a grading run inherits
    (:data:`RUN_ENV`, :data:`distlab.runtime.confine.RANK_ENV`); the grader adds the run's."""
    from distlab.runtime import confine

    return confine.allowed(os.environ if env is None else env, (*confine.RANK_ENV, *RUN_ENV))


def run_contained(cmd: list[str], *, env: dict, cwd, timeout: float,
                  pass_fds=(), stop: threading.Event | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` with everything it starts contained; return (exit status, or None if
    it ran past ``timeout``, or ``stop`` was set, and it was stopped; its combined
    output). When it ends, no process it started is left. With namespaces the run also
    has a network namespace of its own, only ``lo`` up, whose counters are the grader's
    traffic evidence (:mod:`distlab.grading.wire`). A grading run (``env`` holds its
    ranks' memory cap) runs in a cgroup of its own where one can be made
    (:func:`distlab.runtime.cgroup.run_limits`): its pytest, fork server and ranks
    together."""
    mode = containment()
    line = [sys.executable, "-m", "distlab.grading.sandbox", "init", "--", *cmd]
    if mode == "pidns":
        line = _UNSHARE + (["--net"] if network_namespace() else []) + line
    tree = _run_cgroup(env)
    env = dict(env, DISTLAB_PASS_FDS=",".join(map(str, pass_fds)))
    if tree is not None:
        env[RUN_CGROUP] = os.pathsep.join(tree.folders)
    try:
        return _supervise(line, env, cwd, timeout, pass_fds, stop, mode)
    finally:
        if tree is not None:
            tree.remove()


RUN_CGROUP = "DISTLAB_RUN_CGROUP"  # the run's cgroup folders, joined by its supervisor


def _run_cgroup(env: dict) -> cgroup.Tree | None:
    """A grading run's cgroup, or None: not a grading run, or none can be made here."""
    from distlab.runtime import confine

    memory = env.get("DISTLAB_GRADE_MEMORY_MB")
    spec = confine.from_env(env)
    if not memory or spec is None:
        return None
    limit, tasks = cgroup.run_limits(int(float(memory)), int(spec["processes"]))
    return cgroup.make(f"{cgroup.PREFIX}run-{uuid.uuid4().hex}", limit, tasks)


def _supervise(line, env, cwd, timeout, pass_fds, stop, mode) -> tuple[int | None, str]:
    proc = subprocess.Popen(line, env=env,
                            cwd=cwd, pass_fds=list(pass_fds), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    output = _Tail()
    reader = threading.Thread(target=lambda: [output.add(c) for c in iter(
        lambda: proc.stdout.read1(1 << 16), b"")], daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        code = None
        while code is None and time.monotonic() < deadline and not (stop and stop.is_set()):
            try:
                code = proc.wait(max(0.0, min(0.2, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        if code is None:
            _stop(proc, mode)
    finally:
        _kill_session(proc)
    reader.join(5)
    return code, output.text()


OUTPUT_KEPT = 4 << 20  # bytes of a contained run's output the grader keeps (its end)


class _Tail:
    """The last :data:`OUTPUT_KEPT` bytes of a stream, and how much was cut before them."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.size = self.cut = 0

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(self.chunks[0]) >= OUTPUT_KEPT:
            self.size -= len(self.chunks[0])
            self.cut += len(self.chunks.pop(0))

    def text(self) -> str:
        head = f"[… {self.cut / 2**20:.1f} MiB cut]\n" if self.cut else ""
        return head + b"".join(self.chunks).decode(errors="replace")


def _stop(proc: subprocess.Popen, mode: str) -> None:
    """Ask the supervisor to kill its tree (SIGTERM) and wait for it; in a PID namespace the
    supervisor is unshare's child, reached through a pidfd checked to be that child."""
    fd = -1
    if mode == "pidns":
        for pid in _children(of=proc.pid):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            if _children(of=proc.pid).count(pid):  # still unshare's child: the pidfd is it
                break
            os.close(fd)
            fd = -1
        if fd < 0:
            return
        signal.pidfd_send_signal(fd, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)  # the supervisor has swept its tree once it (and unshare) exit
    except subprocess.TimeoutExpired:
        pass
    finally:
        if fd >= 0:
            os.close(fd)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads, while it is unreaped (so its PID and group are
    still its own); in a PID namespace that ends every process inside."""
    if proc.returncode is None and proc.pid > 1:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _children(of: int | None = None) -> list[int]:
    """PIDs whose parent is ``of`` (this process by default), from /proc."""
    me, found = os.getpid() if of is None else of, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def _reap_others(keep: int = 0) -> None:
    """Reap exited children other than ``keep`` (whose status its Popen collects)."""
    for pid in _children():
        if pid != keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _sweep(deadline: float) -> None:
    """Kill every process left below this one. Orphans are re-parented to us (a
    subreaper, or the init of a PID namespace), so killing children until none is left
    reaches every descendant. Each target is our own unreaped child: its PID is ours."""
    while time.monotonic() < deadline:
        _reap_others()
        children = [pid for pid in _children() if pid > 1]
        if not children:
            return
        for pid in children:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.02)


# ------------------------------------------------------------------ the ranks' sandbox

TMPFS_MB = int(os.environ.get("DISTLAB_GRADE_TMPFS_MB", 64))      # each of /tmp, /var/tmp, /dev/shm
PROCESSES = int(os.environ.get("DISTLAB_GRADE_PROCESSES", 256))   # tasks (threads too) per rank
FSIZE_MB = int(os.environ.get("DISTLAB_GRADE_FSIZE_MB", 64))      # the largest file a rank writes


def _kit_checkout() -> Path | None:
    """The checkout the package was imported from (it holds solutions/ or .git), if any."""
    import distlab

    root = Path(distlab.__file__).resolve().parents[2]
    return root if (root / "solutions").is_dir() or (root / ".git").exists() else None


def _answer_files(package: Path) -> set[str]:
    """The source files of the modules that hold the library's answers (found by name:
    importing them here would import torch)."""
    from distlab.grading import answers

    found = set()
    for name in answers.hidden_modules():
        base = package.joinpath(*name.split(".")[1:])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                found.add(str(path))
    return found


def _package_view(dest: Path) -> Path:
    """A copy of the package without the exercise tests and the answer modules (nor their
    bytecode): what graded ranks see in its place. Milliseconds (~1.5 MB)."""
    import shutil

    import distlab

    package = Path(distlab.__file__).resolve().parent
    answers = _answer_files(package)
    hidden_caches = {(os.path.dirname(a), Path(a).stem) for a in answers}
    tests = str(package / "grading" / "exercises")

    def ignore(folder: str, names: list[str]) -> set[str]:
        left = set()
        for name in names:
            path = os.path.join(folder, name)
            if path == tests or path in answers or (
                    os.path.basename(folder) == "__pycache__" and
                    (os.path.dirname(folder), name.split(".")[0]) in hidden_caches):
                left.add(name)
        return left

    shutil.copytree(package, dest, ignore=ignore, symlinks=True)
    return dest


def _readable_paths(kit: Path | None) -> list[str]:
    """What a rank needs to read: the Python installation and its site-packages, the
    folder holding the package, the other folders on the path; nothing else of the kit's
    checkout, and no folder on the path that holds another copy of the kit (an editable
    install of a second checkout puts its ``lib`` there, answers and all)."""
    import distlab

    def inside(path: str, folder: Path | str) -> bool:
        return os.path.commonpath([path, str(folder)]) == str(folder)

    ours = str(Path(distlab.__file__).resolve().parents[1])
    found = [os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), ours]
    for entry in sys.path:
        path = os.path.realpath(entry) if entry else ""
        if path and os.path.isdir(path) and (
                kit is None or not inside(path, kit) or inside(path, os.path.realpath(sys.prefix))) \
                and (path == ours or not os.path.exists(os.path.join(path, "distlab"))):
            found.append(path)
    return found


def readable_by_ranks(folder: str) -> str | None:
    """The folder a graded rank reads (:func:`_readable_paths`) that holds ``folder`` (a
    real path), or None: a folder to keep from the ranks must not be inside one."""
    return next((path for path in _readable_paths(_kit_checkout())
                 if os.path.commonpath([path, folder]) == path), None)


def _spec(tmp: Path, files: list[str], run_as: tuple | None, preload: list[str] = (),
          unseen: list[str] = ()) -> dict:
    import distlab

    from distlab.runtime import confine

    kit = _kit_checkout()
    root = tmp / "root"
    root.mkdir(mode=0o755)
    sp = confine.spec(package=str(Path(distlab.__file__).resolve().parent),
                      package_view=str(_package_view(tmp / "view" / "distlab")),
                      readable=_readable_paths(kit),
                      hidden_roots=([str(kit)] if kit else []) + list(unseen),
                      new_root=str(root), files=files, tmpfs_mb=TMPFS_MB,
                      processes=PROCESSES, fsize_mb=FSIZE_MB, preload=preload)
    if run_as:
        sp["probe_user"] = list(run_as)
    return sp


@functools.lru_cache(maxsize=None)
def confinement() -> str:
    """"" when graded ranks can be confined here (:mod:`distlab.runtime.confine`; checked
    once, in a forked probe), else why not."""
    import tempfile

    from distlab.runtime import confine, privileges

    if sys.platform != "linux":
        return f"no sandbox on {sys.platform}"
    user, _ = privileges.unprivileged_user()
    run_as = tuple(int(x) for x in user.split(":")) if user else None
    with tempfile.TemporaryDirectory(prefix="distlab-probe-") as tmp:
        os.chmod(tmp, 0o755)
        return confine.available(_spec(Path(tmp), [], run_as))


def preloads(import_lines: list[str], rank_imports=()) -> list[str]:
    """What the ranks' fork server imports before it forks a rank, once for all the ranks
    of the run, which would otherwise each import it (matplotlib and the widgets: about
    0.5 CPU-s a rank): the modules that the student's module's ``import_lines`` name
    (``from a import b``: ``a`` and, if it is one, the submodule ``a.b``) and the graded
    tests' ``rank_imports``, of those in the fixed list :data:`distlab.grading.answers.PRELOADS`.
    Importing runs a module's code as the grader, outside the sandbox, so nothing else
    named by a student is imported there: the rank imports it, confined."""
    names: list[str] = []
    for line in import_lines:
        try:
            nodes = ast.parse(line).body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for node in nodes:
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                         if a.name != "*"]
            else:
                continue
            names += [n for n in found if n in answers.PRELOADS and n not in names]
    return names + [n for n in rank_imports if n in answers.PRELOADS and n not in names]


def rank_sandbox(tmp: Path, module: Path, user: str, imports: list[str] = (),
                 rank_imports: list[str] = (), unseen: list[str] = ()) -> dict:
    """The environment that confines every graded rank of a grading run
    (:mod:`distlab.runtime.confine`): the rank's root is built from ``tmp`` (the run's own
    folder); the student's ``module`` is the one file of it the ranks see. The fork server
    imports for the ranks what the module's ``imports`` (its import lines) name
    (:func:`preloads`) and what the graded tests' ranks import later (``rank_imports``,
    the test files' ``RANK_IMPORTS``). The folders ``unseen`` (real paths, none inside a
    folder the ranks read: :func:`readable_by_ranks`) are absent from the rank's root,
    as the kit's checkout is. {} where :func:`confinement` says it cannot be done here."""
    from distlab.runtime import confine

    if confinement():
        return {}
    run_as = tuple(int(x) for x in user.split(":")) if user else None
    return {confine.ENV: json.dumps(_spec(tmp, [str(module)], run_as,
                                          preloads(list(imports), rank_imports), unseen))}


def _init(cmd: list[str]) -> int:
    """The supervisor: start ``cmd``, wait for it (reaping whatever else ends), then
    kill every process left below. SIGTERM stops ``cmd`` early. In the run's cgroup
    (:func:`_run_cgroup`) before anything starts."""
    folders = os.environ.pop(RUN_CGROUP, "")
    if folders:
        cgroup.Tree(folders.split(os.pathsep)).join()
    if os.getpid() != 1:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.environ.pop("DISTLAB_WIRE", None)  # only a loopback brought up here is counted
    if os.getpid() == 1:
        from distlab.grading import wire

        if wire.loopback_up():
            os.environ[wire.ENV] = "lo"
    fds = [int(x) for x in os.environ.pop("DISTLAB_PASS_FDS", "").split(",") if x]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    child = subprocess.Popen(cmd, pass_fds=fds)
    for fd in fds:
        os.close(fd)
    code = None
    while code is None:
        if stop.is_set():
            child.kill()
        try:
            code = child.wait(0.1)
        except subprocess.TimeoutExpired:
            pass
        _reap_others(keep=child.pid)
    _sweep(time.monotonic() + 10.0)
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 3 and argv[0] == "init" and argv[1] == "--":
        return _init(argv[2:])
    print("usage: python -m distlab.grading.sandbox init -- COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
