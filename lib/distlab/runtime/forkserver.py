"""Rank processes in milliseconds: a server that imported torch once and forks them.

Starting a rank as a fresh Python costs seconds (importing torch) — on a 2-core machine
four of them take about 4 s, for every new world size and after every failure. The
launcher instead starts this server once; it imports torch (and nothing that starts a
thread or touches CUDA) and forks each rank on request, which takes milliseconds. The
same idea as ``multiprocessing``'s forkserver with preloaded modules, kept minimal so
that the launcher controls each child's pipes, session and lifetime.

Safety rules, because a wrong PID in a kill can end every process of the user:

* Requests and replies are plain data (:mod:`distlab.runtime.plain`), never a pickle:
  a rank that reached the server's socket could not make either side run code.
* Every request carries a number and its reply carries it back; an exchange that is
  interrupted, times out or gets a reply out of turn throws the server away (its
  ranks die with it), so no later request can read an earlier one's answer.
* The server hands the launcher a pidfd of each child (SCM_RIGHTS): signals go through
  it, and a pidfd never reaches another process, even after its PID is recycled.
* The server never reaps a child until the launcher asks. Until then the PID, and the
  process group the child leads, stay the child's; group kills go through the server,
  which checks that the child is its own and unreaped. Nothing is ever sent to PID ≤ 1.

The grader's pytest forks the server from itself instead (:meth:`ForkServer.forked`),
before it imports any test, so that one import of torch serves both.

Linux only (fork after importing torch is unsafe on macOS); elsewhere the launcher starts
ranks as fresh interpreters. The server exits when the launcher's end of its socket
closes, and its children die with it (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import gc
import importlib
import io
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
import warnings

from distlab.runtime import absent, plain

_MAX_MESSAGE = 1 << 20
REPLY_TIMEOUT = 30.0  # seconds the server may take to answer one request


class ForkServerError(OSError):
    """The fork server died, or an exchange with it broke; the server is discarded."""


def wait_readable(fd: int, timeout: float | None) -> bool:
    """True when ``fd`` becomes readable within ``timeout`` seconds (poll: any fd number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    ms = None if timeout is None else max(0, int(timeout * 1000))
    return bool(poller.poll(ms))


class Child:
    """A process forked by the server: waitable (``fileno``), killable, with an exit code."""

    def __init__(self, server: "ForkServer", pid: int, pidfd: int):
        if pid <= 1:
            raise ForkServerError(f"the fork server answered with PID {pid}")
        self.server, self.pid, self.fd = server, pid, pidfd
        self._code: int | None = None

    def fileno(self) -> int:
        return self.fd

    def wait(self, timeout: float | None = None) -> bool:
        """True once the process has exited (waits up to ``timeout`` seconds)."""
        return self.fd < 0 or wait_readable(self.fd, timeout)

    def alive(self) -> bool:
        return not self.wait(0)

    def kill(self) -> None:
        """SIGKILL the child and its process group (never raises)."""
        if self.fd >= 0:
            try:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            except OSError:  # already gone
                pass
        if self._code is None:
            self.server.kill_group(self.pid)

    def returncode(self, timeout: float = 5.0) -> int | None:
        """As subprocess: the exit status, or minus the signal that killed it; reaps the
        child. None if it has not exited within ``timeout``."""
        if self._code is None:
            if not self.wait(timeout):
                return None
            self._code = self.server.reap(self.pid)
        return self._code

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Forked:
    """``Popen``'s ``poll``, ``wait`` and ``kill`` for a child forked by this process,
    through a pidfd (a signal never reaches a recycled PID)."""

    def __init__(self, pid: int):
        self.pid, self.fd, self.returncode = pid, os.pidfd_open(pid), None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not wait_readable(self.fd, timeout):
                raise subprocess.TimeoutExpired("distlab.runtime.forkserver", timeout)
            self._reap(0)
        return self.returncode

    def _reap(self, flags: int) -> None:
        pid, status = os.waitpid(self.pid, flags)
        if pid:
            self.returncode = _exit_code(status)
            os.close(self.fd)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            except OSError:  # already exited
                pass


_SERVER: int | None = None  # this process's PID while it serves as a fork server


def _refuse_in_server() -> None:
    """A fork server never starts another (whatever it imported tried to launch ranks):
    servers starting servers would multiply without end."""
    if _SERVER == os.getpid():
        raise ForkServerError("a rank fork server cannot start a launch (a module it "
                              "imported tried to)")


class ForkServer:
    """The launcher's handle on the server process."""

    def __init__(self):
        _refuse_in_server()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, DISTLAB_FORKSERVER_FD=str(theirs.fileno()),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "distlab.runtime.forkserver"], env=env,
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            theirs.close()
        self._adopt(ours)

    def _adopt(self, sock: socket.socket) -> None:
        sock.settimeout(REPLY_TIMEOUT)
        self.sock = sock
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.broken = False

    @classmethod
    def forked(cls) -> "ForkServer | None":
        """A server forked from this process, whose imports (:func:`prepare`) it then
        shares: a fresh one imports torch again (about 2 CPU-seconds). None where this
        process runs another Python thread, which may hold a lock the child would then
        never see released (the native pools that numpy and torch start at import, such
        as OpenBLAS's, are the ones every rank is forked with, made safe by their fork
        handlers). Only for a process
        that holds nothing a rank may see: the grader's pytest before it imports a test
        (:mod:`distlab.grading.plugin`). The server keeps no descriptor but its socket
        and the standard three, and has a session of its own."""
        _refuse_in_server()
        _import_shared()
        if threading.active_count() != 1:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with warnings.catch_warnings():  # Python 3.12 counts the native pools' threads too
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                os.setsid()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                keep = {0, 1, 2, theirs.fileno()}
                for fd in map(int, os.listdir("/proc/self/fd")):
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:  # the listing's own descriptor, already closed
                            pass
                prepare()
                serve(theirs)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        server = cls.__new__(cls)
        server.proc = _Forked(pid)
        server._adopt(ours)
        return server

    def _ask(self, message, fds=()):
        """One request, one reply; anything that breaks the exchange discards the server."""
        with self.lock:
            if self.broken:
                raise ForkServerError("the rank fork server was discarded")
            request = next(self.ids)
            try:
                socket.send_fds(self.sock, [plain.dumps((request, message))], list(fds))
                data, got_fds, _, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, 1)
                if not data:
                    raise ForkServerError("the rank fork server exited")
                number, reply = plain.loads(data)
                if number != request:
                    for fd in got_fds:
                        os.close(fd)
                    raise ForkServerError(f"the fork server answered request {number} "
                                          f"instead of {request}")
                return reply, got_fds
            except BaseException:  # an interrupt, a timeout, a dead server: never reuse it
                self._discard()
                raise

    def spawn(self, env: dict, channel: int, stdout: int, stderr: int) -> Child:
        """Fork a rank running ``distlab.runtime.worker.main`` with ``env``; the three file
        descriptors become its channel to the launcher, its stdout and its stderr."""
        try:
            (_, pid), fds = self._ask(("spawn", env), (channel, stdout, stderr))
        except (OSError, EOFError, ValueError) as exc:
            raise ForkServerError(f"the rank fork server failed ({exc})") from exc
        if len(fds) != 1:
            raise ForkServerError("the fork server sent no pidfd for the new rank")
        return Child(self, pid, fds[0])

    def reap(self, pid: int) -> int:
        """The exit status of an exited child, which the server then forgets."""
        try:
            (_, code), _ = self._ask(("reap", pid))
        except (OSError, EOFError, ValueError):
            return -signal.SIGKILL  # the server is gone and its children with it
        return code

    def kill_group(self, pid: int) -> bool:
        """SIGKILL the process group led by the server's unreaped child ``pid``; True if
        the server sent the signal (it refuses for a PID that is not its unreaped child)."""
        if self.broken or not self.alive():
            return False
        try:
            (_, _, sent), _ = self._ask(("killpg", pid))
        except (OSError, EOFError, ValueError):
            return False
        return sent

    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

    def _discard(self) -> None:
        self.broken = True
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()  # Popen knows it has not reaped it: the PID is still ours
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Close the socket: the server exits, and any children it still has die."""
        with self.lock:
            if self.broken:
                return
            self.broken = True
            self.sock.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


# ---------------------------------------------------------------------- the server side


def _child(env: dict, channel: int, stdout: int, stderr: int, server: int) -> None:
    from distlab.runtime import confine, worker
    from distlab.runtime.privileges import PR_SET_PDEATHSIG, prctl

    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # from the first moment: a server that dies
    if os.getppid() != server:               # before the rank is set up takes it along
        os._exit(1)
    os.setsid()  # a session of its own: the launcher kills the rank's whole group
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    run_as = env.pop("DISTLAB_RUN_AS", None)
    user = tuple(int(x) for x in run_as.split(":")) if run_as else None
    sandbox = confine.from_env(env)
    env.pop(confine.ENV, None)  # read here, never seen by the student's code
    if sandbox is not None:  # the autograder's ranks: confined (the relay stays outside)
        files = worker.rank_files(env["DISTLAB_DIR"], int(env["RANK"]))
        confine.enter(sandbox, user, list(files.values()))
        env.update(HOME="/tmp", TMPDIR="/tmp")  # its own capped tmpfs
    elif user:  # the autograder without namespaces: another user and the filter, at least
        from distlab.runtime.privileges import drop_privileges

        drop_privileges(*user)
        if confine.filter_available():
            confine.install_seccomp()
    env.update(DISTLAB_FD=str(channel), DISTLAB_PARENT_PID=str(os.getppid()))
    if env.get("DISTLAB_PLAIN") == "1":  # a graded rank: nothing of what it was forked with
        confine.forget_environment(env)
    else:
        os.environ.clear()
        os.environ.update(env)
    worker.main()  # sets PR_SET_PDEATHSIG, which a change of user would have cleared


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


_TREES: dict = {}  # a graded rank's PID → its cgroup (distlab.runtime.cgroup), until reaped


def _rank_cgroup(env: dict):
    """A cgroup for a graded rank's whole tree (its spec's processes, its memory cap plus
    :data:`distlab.runtime.cgroup.SLACK_MB`), or None: not a graded rank, or none can be
    made here."""
    from distlab.runtime import cgroup, confine

    sandbox = confine.from_env(env)
    memory = env.get("DISTLAB_GRADE_MEMORY_MB")
    if sandbox is None or not memory:
        return None
    # a name of its own: PIDs repeat from one PID namespace to the next
    return cgroup.make(f"{cgroup.PREFIX}rank-{uuid.uuid4().hex}",
                       (int(float(memory)) + cgroup.SLACK_MB) << 20, int(sandbox["processes"]))


def _serve(sock, children: set[int]) -> bool:
    """Answer one request; False when the launcher is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
    except OSError:
        return False
    if not data:
        return False
    try:
        request, message = plain.loads(data)
    except (ValueError, TypeError):
        return False  # not a request of the launcher's
    reply_fds: list[int] = []
    if message[0] == "spawn":
        server = os.getpid()
        tree = _rank_cgroup(message[1])
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                if tree is not None:  # before anything of the rank's runs
                    tree.join()
                _child(message[1], *fds, server)
            except BaseException:  # a rank that fails to start says why on its stderr
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        if tree is not None:
            _TREES[pid] = tree
        reply_fds = [os.pidfd_open(pid)]
        reply = ("pid", pid)
    elif message[0] == "killpg":
        pid, sent = message[1], False
        if pid in children and pid > 1:  # ours and unreaped: the group is the child's
            try:
                os.killpg(pid, signal.SIGKILL)
                sent = True
            except (ProcessLookupError, PermissionError):
                pass
        reply = ("killed", pid, sent)
    elif message[0] == "reap":
        pid, code = message[1], -1
        if pid in children:
            children.discard(pid)
            try:
                code = _exit_code(os.waitpid(pid, 0)[1])
            except ChildProcessError:
                pass
            if pid in _TREES:
                _TREES.pop(pid).remove()
        reply = ("status", code)
    else:
        reply = ("error", f"unknown request {message[0]!r}")
    socket.send_fds(sock, [plain.dumps((request, reply))], reply_fds)
    for fd in reply_fds:
        os.close(fd)
    return True


def _import_shared() -> None:
    """What the server shares with a process that forks it: torch, and nothing of the kit
    that may be absent from the ranks (:mod:`distlab.runtime.absent`)."""
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


def prepare() -> None:
    """Import what every rank needs, the graded exercises' answers made absent first
    (:mod:`distlab.runtime.absent`). Nothing here may start a thread or touch CUDA."""
    absent.install_from_env("modules")
    _import_shared()
    from distlab import comm  # noqa: F401
    from distlab.runtime import confine, privileges, worker  # noqa: F401


def serve(sock: socket.socket) -> None:
    """Fork ranks on the requests of ``sock`` until its other end closes."""
    from distlab.runtime import confine, privileges

    global _SERVER
    _SERVER = os.getpid()
    privileges.make_non_dumpable()  # a rank of the same user cannot trace it nor take its fds
    sandbox = confine.from_env(os.environ)
    # graded ranks: what the student's module and the graded tests' ranks import, once here
    # rather than in every rank; one that fails here fails again in the rank that imports it
    for name in sandbox.get("preload", ()) if sandbox else ():
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 (SystemExit too: the server must live on)
            pass
    absent.install_from_env("later")  # the answers no rank of this run imported
    gc.freeze()  # what is imported stays out of every collection: a rank's collector never
    #              walks (and so never copies, page by page) the heap it shares with us

    children: set[int] = set()
    warmed = bool(sandbox)  # graded ranks: the grader chose what to import, above
    while True:
        if not warmed and not wait_readable(sock.fileno(), 0.5):
            # While idle (never while ranks wait to be forked): what torch's optimizers
            # import on their first step, seconds a rank would otherwise spend itself.
            import torch._dynamo  # noqa: F401

            gc.freeze()
            warmed = True
        if not _serve(sock, children):
            break


def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop("DISTLAB_FORKSERVER_FD")))
    prepare()
    serve(sock)


if __name__ == "__main__":  # the module proper, not this __main__ copy, holds _SERVER
    importlib.import_module("distlab.runtime.forkserver").main()
