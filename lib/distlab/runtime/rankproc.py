"""One rank process and every OS resource it holds, with one idempotent ``terminate()``.

A :class:`RankProcess` owns the rank's process (forked by :mod:`distlab.runtime.forkserver` on
Linux, a fresh interpreter elsewhere), its pidfd, its channel to the launcher, its
captured stdout and stderr, and its status-board file. Signals go only to processes this
launcher started, through pidfds where the platform has them; ``terminate()`` kills,
waits under the caller's deadline, reaps and closes, and may be called any number of
times, from any failure path.

Output is read as it comes by a thread per pipe into a buffer; :meth:`Capture.take`
with ``drain=True`` first reads whatever the pipe holds, so once a rank has said on its
channel that a launch is over, everything it printed during that launch is in hand —
the end of a launch is never marked inside the output itself.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from distlab.runtime import plain
from distlab.runtime.forkserver import ForkServer, wait_readable

MAX_BUFFERED = 64 << 20  # bytes of one pipe's output kept between two takes
SANDBOX_BUFFERED = 1 << 20  # the same for the autograder's ranks (students' code prints)


def create_board(path: str, run_as=None) -> None:
    """Create a rank's status-board file: a new file (O_EXCL: never an entry that exists,
    link or not; O_NOFOLLOW), zeroed and given to ``run_as`` through its descriptor, so
    that root never acts on a path that a student's process could have planted."""
    from distlab.comm import StatusBoard

    create_file(path, run_as, b"\0" * StatusBoard.SIZE)


def create_file(path: str, run_as=None, content: bytes = b"") -> None:
    """Create ``path`` as :func:`create_board` does, holding ``content``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, content)
        if run_as:
            os.fchown(fd, *run_as)
    finally:
        os.close(fd)


class Capture:
    """A rank's stdout or stderr pipe, read by a thread as it comes."""

    def __init__(self, fd: int, limit: int = MAX_BUFFERED):
        os.set_blocking(fd, False)
        self.fd, self.limit = fd, limit
        self.lock = threading.Lock()
        self.buffer = bytearray()
        self.dropped = 0
        self.eof = False
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._pump, daemon=True, name="distlab-output").start()

    def _pump(self) -> None:
        import select

        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    return
                with self.lock:
                    if not self._read_available():
                        return
        finally:
            with self.lock:
                self.eof = True
                os.close(self.fd)
            os.close(self._wake_r)

    def _read_available(self) -> bool:
        """Append what the pipe holds now (lock held); False at end of file."""
        while not self.eof:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            room = self.limit - len(self.buffer)
            self.buffer += chunk[:max(room, 0)]
            self.dropped += max(len(chunk) - room, 0)
        return False

    def take(self, drain: bool = False) -> bytes:
        """The output read so far (all the pipe holds now, with ``drain``), once."""
        with self.lock:
            if drain and not self.eof:
                self._read_available()
            data = bytes(self.buffer)
            if self.dropped:
                data += f"\n[… {self.dropped / 2**20:.1f} MiB cut]\n".encode()
                self.dropped = 0
            self.buffer.clear()
        return data

    def close(self) -> None:
        """Stop the reading thread (idempotent)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # the thread has ended already (end of file)
                pass
            os.close(self._wake_w)
            self._wake_w = -1


class _Spawned:
    """A rank started as a fresh interpreter, where forking after torch is unsafe (macOS).
    Same interface as :class:`distlab.runtime.forkserver.Child`; ``subprocess`` tracks whether it
    has been reaped, so a signal never reaches a recycled PID."""

    def __init__(self, env: dict, channel: int, stdout: int, stderr: int, run_as=None):
        from distlab.runtime import absent

        env = dict(env, DISTLAB_FD=str(channel), DISTLAB_PARENT_PID=str(os.getpid()),
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        if absent.ENV in os.environ:  # a fresh interpreter makes the answers absent itself
            env.setdefault(absent.ENV, os.environ[absent.ENV])
        env.pop("DISTLAB_RUN_AS", None)
        user = {} if run_as is None else {"user": run_as[0], "group": run_as[1],
                                          "extra_groups": []}
        self.proc = subprocess.Popen([sys.executable, "-m", "distlab.runtime.worker"], env=env,
                                     pass_fds=[channel], stdin=subprocess.DEVNULL,
                                     stdout=stdout, stderr=stderr, start_new_session=True,
                                     **user)
        self.pid = self.proc.pid

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:  # not reaped: the PID and its group are still the rank's
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def returncode(self, timeout: float = 5.0) -> int | None:
        return self.proc.returncode if self.wait(timeout) else None

    def close(self) -> None:
        pass


_forkserver: ForkServer | None = None
_forkserver_lock = threading.Lock()


def _start(env: dict, channel: int, stdout: int, stderr: int, run_as):
    """A rank process: forked by the warm fork server on Linux, a fresh Python elsewhere."""
    global _forkserver
    if sys.platform != "linux":
        return _Spawned(env, channel, stdout, stderr, run_as)
    with _forkserver_lock:
        if _forkserver is None or not _forkserver.alive():
            _forkserver = ForkServer()
        server = _forkserver
    if run_as is not None:
        env = dict(env, DISTLAB_RUN_AS=f"{run_as[0]}:{run_as[1]}")
    return server.spawn(env, channel, stdout, stderr)


def prefork() -> None:
    """Fork the rank fork server from this process now (:meth:`ForkServer.forked`), so
    that it shares this process's import of torch; where that cannot be done, the first
    launch starts a fresh one as usual. Linux only, and only in a process that holds
    nothing a rank may see."""
    global _forkserver
    if sys.platform != "linux":
        return
    with _forkserver_lock:
        if _forkserver is None or not _forkserver.alive():
            _forkserver = ForkServer.forked()


def stop_forkserver() -> None:
    global _forkserver
    with _forkserver_lock:
        server, _forkserver = _forkserver, None
    if server is not None:
        server.close()


class RankProcess:
    """Rank ``rank`` of a pool: process, pidfd, channel, output, status-board file."""

    def __init__(self, rank: int, env: dict, workdir: str, run_as=None,
                 output_limit: int = MAX_BUFFERED):
        """The rank's status board (``workdir``/status-RANK) must exist: :func:`create_board`."""
        from distlab.runtime.worker import rank_files

        self.rank = rank
        files = rank_files(workdir, rank)
        self.status_path, self.stack_path = files["status"], files["stack"]
        self.proc = self.conn = self.out = self.err = None
        self._terminated = False
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.out, self.err = Capture(out_r, output_limit), Capture(err_r, output_limit)
            self.conn = Connection(ours.detach())
            self.proc = _start(env, theirs.fileno(), out_w, err_w, run_as)
        except BaseException:
            self.terminate(time.monotonic())
            raise
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
            ours.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def waitables(self) -> list:
        """What ``multiprocessing.connection.wait`` can watch: the channel, and the
        process's pidfd where there is one (readable once it has exited)."""
        return [self.conn] + ([self.proc] if hasattr(self.proc, "fileno") else [])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def send(self, message) -> None:
        self.conn.send(message)

    def recv(self):
        """The next message from the rank, decoded as plain data (the rank may run
        untrusted code: nothing it sends is unpickled here)."""
        return plain.loads(self.conn.recv_bytes())

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank if it is still running (never to anything else)."""
        fd = getattr(self.proc, "fd", -1)
        try:
            if fd >= 0:
                signal.pidfd_send_signal(fd, sig)
            elif self.alive():
                os.kill(self.proc.pid, sig)
        except OSError:
            pass

    def kill(self) -> None:
        """SIGKILL the rank and its process group, without waiting (never raises)."""
        if self.proc is not None and not self._terminated:
            try:
                self.proc.kill()
            except Exception:  # noqa: BLE001 — a dying fork server must not stop the others
                pass

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode(timeout=1.0)

    def exit_reason(self) -> str:
        code = self.returncode()
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name} (signal {-code})"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def terminate(self, deadline: float) -> None:
        """Kill, wait until ``deadline`` (time.monotonic()), reap and close everything.
        Idempotent; never raises."""
        if self._terminated:
            return
        self.kill()
        self._terminated = True
        if self.proc is not None:
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
                self.proc.returncode(timeout=0)
            except Exception:  # noqa: BLE001
                pass
            self.proc.close()
        if self.conn is not None:
            self.conn.close()
        for capture in (self.out, self.err):
            if capture is not None:
                capture.close()


def wait_exit(procs, timeout: float) -> None:
    """Wait until every process in ``procs`` has exited, or ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.proc is not None:
            p.proc.wait(max(0.0, deadline - time.monotonic()))


__all__ = ["Capture", "RankProcess", "create_board", "create_file", "prefork", "stop_forkserver", "wait_exit", "wait_readable"]
