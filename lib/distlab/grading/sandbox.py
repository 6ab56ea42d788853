"""Untrusted code in the autograder: where a student's code runs, as whom, and how it ends.

A student's notebook can run anything when it is imported, so the grade must never
depend on a process that ran it. The layers, from the grader down:

1. **Grades come from processes that never run student code.** The grader and each
   exercise's pytest process never import the student's module: tests reach it through
   :class:`Student`, whose ``student.NAME`` resolves to the real object only inside
   launched ranks (or, called directly, inside a one-rank launch). Every check runs in the
   pytest process on what the ranks return.
2. **Results cross as plain data.** Ranks of a sandbox (``DISTLAB_SANDBOX=1``) answer
   with :mod:`distlab.runtime.plain`, never a pickle, so they cannot make the tests run code.
3. **An unprivileged user.** Where the grader runs as root, ranks run as the user that
   :func:`unprivileged_user` found (``nobody`` unless ``DISTLAB_SANDBOX_USER`` names
   another): they cannot write the grader's files or signal its processes.
4. **Nothing outlives grading.** Each exercise's pytest runs under :func:`run_contained`:
   in a new PID namespace where the kernel allows it (as root), otherwise under a child
   subreaper. When pytest ends, every process it left behind — daemons started with
   ``start_new_session=True`` included — is killed before the grade is read.
5. **The report travels through a pipe** that only pytest inherits, not a file; the
   grading processes are made non-dumpable, so a student's process running as the same
   user cannot open their descriptors through /proc.

What this does not guarantee: code running as the grader's own user (a student grading
their own laptop) can edit the tests themselves; and what is observed *inside* a rank —
which collectives ran (CommLog), what the status board says — is reported by a process
that ran the student's code, so a deliberate forgery of those observations is possible.
Answers (values, gradients, weights) are always checked outside it.
"""
from __future__ import annotations

import ast
import builtins
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from distlab.runtime.privileges import PR_SET_CHILD_SUBREAPER, prctl

IMPORT_TIMEOUT = float(os.environ.get("DISTLAB_IMPORT_TIMEOUT", 60))  # seconds to import it
CALL_TIMEOUT = 60.0    # seconds for one direct call of a student's function


# ----------------------------------------------------------------- the student's module


class StudentImportError(AssertionError):
    """The student's module could not be imported in a rank (every test of it fails)."""


class Student:
    """The student's exercise module, seen from a process that must not import it.

    ``student.NAME`` is a :class:`StudentRef` for each top-level name the module defines
    (read from its source, never executed here)."""

    def __init__(self, path):
        self.path = str(path)
        self.names = _defined_names(Path(path).read_text())

    def __getattr__(self, name: str) -> "StudentRef":
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self.names:
            raise AttributeError(f"your notebook defines no {name!r}: its exercise cell must "
                                 f"define a function or class of exactly that name")
        return StudentRef(self.path, name)

    def check_import(self, timeout: float = IMPORT_TIMEOUT) -> None:
        """Import the module once in a sandboxed rank; :class:`StudentImportError` says
        in plain words why it failed (an error, an endless loop, an exit at import)."""
        from distlab import launch

        try:
            launch.run(_import, 1, self.path, backend="gloo", timeout=timeout)
        except launch.LaunchTimeout:
            raise StudentImportError(
                f"your notebook's exercise cells did not finish importing within "
                f"{timeout:g} s: a cell runs something endless at the top level (code that "
                f"should sit inside a function?)") from None
        except launch.RankError as exc:
            raise StudentImportError(
                f"importing your notebook's exercise cells raised {exc.exc_type}: "
                f"{exc.message}") from None
        except launch.LaunchError as exc:
            raise StudentImportError(
                f"importing your notebook's exercise cells ended the process: "
                f"{str(exc).splitlines()[0]}") from None


class StudentRef:
    """One name of the student's module: pickled, it resolves in the rank that loads it;
    called here, the call runs in a sandboxed one-rank launch and returns plain data.
    An exception the student's code raises comes back as the builtin exception of the
    same class where there is one (ValueError, TypeError, NotImplementedError, ...)."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name

    def __reduce__(self):
        return _resolve, (self.path, self.name)

    def __repr__(self) -> str:
        return f"<the student's {self.name}>"

    def __call__(self, *args, **kwargs):
        from distlab import launch

        try:
            return launch.run(_call, 1, self, args, kwargs, backend="gloo",
                              timeout=CALL_TIMEOUT)[0]
        except launch.RankError as exc:
            raise _as_builtin(exc) from None


def _defined_names(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _as_builtin(exc) -> BaseException:
    cls = getattr(builtins, exc.exc_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(exc.message)
    return exc


@functools.lru_cache(maxsize=None)
def _module(path: str):
    """The student's module, imported once per rank (inside the rank only)."""
    import importlib.util

    name = f"student_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(path: str, name: str):
    return getattr(_module(path), name)


def _import(path: str) -> None:
    _module(path)


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


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


def run_contained(cmd: list[str], *, env: dict, cwd, timeout: float,
                  pass_fds=()) -> tuple[int | None, str]:
    """Run ``cmd`` with everything it starts contained; return (exit status, or None if
    it ran past ``timeout`` and was stopped; its combined output). When it ends, no
    process it started is left."""
    mode = containment()
    line = [sys.executable, "-m", "distlab.grading.sandbox", "init", "--", *cmd]
    if mode == "pidns":
        line = _UNSHARE + line
    proc = subprocess.Popen(line, env=dict(env, DISTLAB_PASS_FDS=",".join(map(str, pass_fds))),
                            cwd=cwd, pass_fds=list(pass_fds), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(
        lambda: proc.stdout.read(1 << 16), b"")), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
        _stop(proc, mode)
    finally:
        _kill_session(proc)
    reader.join(5)
    return code, b"".join(chunks).decode(errors="replace")


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


def _init(cmd: list[str]) -> int:
    """The supervisor: start ``cmd``, wait for it (reaping whatever else ends), then
    kill every process left below. SIGTERM stops ``cmd`` early."""
    if os.getpid() != 1:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
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
