"""Rank processes in milliseconds: a server that imported torch once and forks them.

Starting a rank as a fresh Python costs seconds (importing torch) — on a 2-core machine
four of them take about 4 s, for every new world size and after every failure. The
launcher instead starts this server once; it imports torch (and nothing that starts a
thread or touches CUDA) and forks each rank on request, which takes milliseconds. The
same idea as ``multiprocessing``'s forkserver with preloaded modules, kept minimal so
that the launcher controls each child's pipes, session and lifetime.

Linux only (fork after importing torch is unsafe on macOS); elsewhere the launcher starts
ranks as fresh interpreters. The server exits when the launcher's end of its socket
closes, and its children die with it (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import io
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading

_MAX_MESSAGE = 1 << 20


class Child:
    """A process forked by the server: waitable (``fileno``), killable, with an exit code."""

    def __init__(self, server: "ForkServer", pid: int):
        self.server, self.pid = server, pid
        self.fd = os.pidfd_open(pid)
        self._code: int | None = None

    def fileno(self) -> int:
        return self.fd

    def wait(self, timeout: float | None = None) -> bool:
        """True once the process has exited (waits up to ``timeout`` seconds)."""
        return bool(select.select([self.fd], [], [], timeout)[0])

    def alive(self) -> bool:
        return not self.wait(0)

    def kill(self) -> None:
        for kill, target in ((os.killpg, self.pid), (os.kill, self.pid)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def returncode(self) -> int:
        """As subprocess: the exit status, or minus the signal that killed it."""
        if self._code is None:
            self.wait()
            self._code = self.server.status(self.pid)
        return self._code

    def close(self) -> None:
        os.close(self.fd)


class ForkServer:
    """The launcher's handle on the server process."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, DISTLAB_FORKSERVER_FD=str(theirs.fileno()),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "distlab.forkserver"], env=env,
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    def _ask(self, message, fds=()):
        with self.lock:
            socket.send_fds(self.sock, [pickle.dumps(message)], list(fds))
            data = self.sock.recv(_MAX_MESSAGE)
        if not data:
            raise OSError("the rank fork server exited")
        return pickle.loads(data)

    def spawn(self, env: dict, channel: int, stdout: int, stderr: int) -> Child:
        """Fork a rank running ``distlab.worker.main`` with ``env``; the three file
        descriptors become its channel to the launcher, its stdout and its stderr."""
        _, pid = self._ask(("spawn", env), (channel, stdout, stderr))
        return Child(self, pid)

    def status(self, pid: int) -> int:
        return self._ask(("status", pid))[1]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _child(env: dict, channel: int, stdout: int, stderr: int) -> None:
    from distlab import worker

    os.setsid()  # a session of its own: the launcher kills the rank's whole group
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env, DISTLAB_FD=str(channel), DISTLAB_PARENT_PID=str(os.getppid()))
    worker.main()


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop("DISTLAB_FORKSERVER_FD")))
    # What every rank needs, imported once. Nothing here may start a thread or CUDA.
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from distlab import comm, worker  # noqa: F401

    codes: dict[int, int] = {}
    while True:
        ready = select.select([sock], [], [], 1.0)[0]
        while True:  # reap the ranks that have exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            codes[pid] = _exit_code(status)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            break
        if not data:  # the launcher is gone
            break
        message = pickle.loads(data)
        if message[0] == "spawn":
            pid = os.fork()
            if pid == 0:
                try:
                    sock.close()
                    _child(message[1], *fds)
                finally:
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            sock.send(pickle.dumps(("pid", pid)))
        elif message[0] == "status":
            pid = message[1]
            if pid not in codes:
                try:
                    codes[pid] = _exit_code(os.waitpid(pid, 0)[1])
                except ChildProcessError:
                    codes[pid] = -1
            sock.send(pickle.dumps(("status", codes.pop(pid))))


if __name__ == "__main__":
    main()
