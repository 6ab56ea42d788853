"""The warm pool: ``world_size`` rank processes joined in one process group, reused
across launches, and every way a launch ends (answers, a rank's error, a crash, a
timeout), each told with what the other ranks were doing."""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait

from distlab.runtime import confine, plain, worker
from distlab.runtime.errors import (LaunchError, LaunchTimeout, RankCrashed, RankError,
                                    exception_line, own_frame)
from distlab.runtime.forkserver import ForkServerError
from distlab.runtime.rankproc import (MAX_BUFFERED, SANDBOX_BUFFERED, RankProcess,
                                     create_board, create_file, wait_exit)
from distlab.runtime.report import (Shown, error_field, first_line, indent, innermost,
                                    missing_package_hint, tidy_stack, update_bar)

START_TIMEOUT = 120.0    # seconds for fresh ranks to import torch and rendezvous
WARM_MEMORY_MB = float(os.environ.get("DISTLAB_WARM_MEMORY_MB", 4096))
RANK_MB = 160  # resident MiB of one rank with torch imported and its gloo group joined
#                (measured: 158 MiB at 1, 4 and 8 ranks; counted whole, though ranks forked
#                from the fork server share most of it, so the bound errs on the safe side)


def available_mb() -> int | None:
    """MiB this machine (or this container's memory cgroup, if lower) can still give."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) // 1024 for line in f
                      if line.startswith("MemAvailable:")]
    except (OSError, ValueError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") >> 20)
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append((int(limit) - int(g.read())) >> 20)
    return min(found) if found else None


def check_capacity(world_size: int) -> None:
    """Refuse, before any process starts, a world this machine cannot hold: each rank is a
    process of about :data:`RANK_MB` MiB (``launch.run(fn, 10000)`` once ran the machine
    out of memory and the caller was killed)."""
    free = available_mb()
    if free is None or world_size * RANK_MB <= free:
        return
    room = max(free // RANK_MB, 0)
    raise LaunchError(
        f"world_size={world_size} is more ranks than this machine can start: each rank is a "
        f"process of its own (torch imported, a process group joined), about {RANK_MB} MiB, "
        f"and {free} MiB are free here, room for {room} rank{'s' if room != 1 else ''}. Ask "
        f"for at most {room} (the labs use 2 to 8), or spread a larger world over machines "
        f"under torchrun.")


def _new_workdir() -> tuple[str, int]:
    """A private directory for one pool, and a descriptor holding the lock that marks it
    in use; directories whose lock nobody holds (their launcher died) are removed. A
    directory younger than a minute is left alone: between its creation and the lock
    another launcher would see it unlocked."""
    import fcntl

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not re.fullmatch(r"distlab-\d+-\w+", name):
            continue
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if st.st_uid != os.geteuid() or time.time() - st.st_mtime < 60:
                continue
            fd = os.open(os.path.join(path, ".lock"), os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while in use
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)
    workdir = tempfile.mkdtemp(prefix=f"distlab-{os.getpid()}-")
    lock = os.open(os.path.join(workdir, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return workdir, lock


def _open_own(path: str) -> int | str:
    """A descriptor of ``path``, a file in a rank's folder, which the rank's user (a
    student's code, when grading) may have replaced: opened without following a link or
    blocking (a FIFO once hung grading for 1038 s); "(not a regular file)" when it is not
    one, and nothing is left open. OSError when it cannot be opened."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return "(not a regular file)"


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold Ctrl-C back while the ranks are being killed, then deliver it: a second
    interrupt must not leave ranks alive (main thread only, where signals land)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def _without_sources(payload: bytes) -> bytes:
    """A launch's payload without the source lines it carries for tracebacks: ranks of the
    autograder run students' code, and the calls come from the exercise tests, whose
    source must not reach them (the student's own module is a file the ranks can read)."""
    import cloudpickle

    data, _ = cloudpickle.loads(payload)  # made by this process's launcher, not a rank
    return cloudpickle.dumps((data, {}))


class Pool:
    """``world_size`` rank processes joined in one process group, reused across launches."""

    _ids = itertools.count()

    def __init__(self, world_size: int, name: str, sandbox=None):
        check_capacity(world_size)
        self.world_size, self.backend, self.sandbox = world_size, name, sandbox
        self.ranks: list[RankProcess] = []
        self.closed = False
        self.reusable = True
        run_as = sandbox or None
        self.workdir, self._lock = _new_workdir()
        for r in range(world_size):  # every file root makes there, before the folder is given
            files = worker.rank_files(self.workdir, r)
            create_board(files["status"], run_as)
            if sandbox is not None:  # a confined rank is given these files, not the folder
                create_file(files["stack"], run_as)
                if r == 0:
                    create_file(files["store"], run_as)
        if run_as:
            os.chown(self.workdir, *run_as)
        if sandbox is None:
            env = dict(os.environ)
            for key in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "DISTLAB_SANDBOX",
                        "DISTLAB_SANDBOX_USER", "DISTLAB_IN_PROCESS"):
                env.pop(key, None)
        else:  # graded ranks: of the grader's environment, only what confine.RANK_ENV allows
            env = confine.allowed(os.environ, confine.RANK_ENV)
            env.update({key: os.environ[key] for key in confine.RANK_SETUP if key in os.environ},
                       DISTLAB_PLAIN="1", HOME=self.workdir, TMPDIR=self.workdir)  # a
            #          confined rank's are its own /tmp (distlab.runtime.forkserver._child)
        env.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   DISTLAB_WORKER="1", DISTLAB_BACKEND=name, DISTLAB_DIR=self.workdir,
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
        try:
            for r in range(world_size):
                self.ranks.append(RankProcess(
                    r, dict(env, RANK=str(r), LOCAL_RANK=str(r)), self.workdir, run_as,
                    SANDBOX_BUFFERED if sandbox is not None else MAX_BUFFERED))
            self._wait_ready()
        except ForkServerError as exc:
            self.close(graceful=False)
            raise LaunchError(f"the process that forks the ranks failed ({exc}); the next "
                              f"launch starts a new one") from exc
        except BaseException:
            self.close(graceful=False)
            raise

    def _wait_ready(self) -> None:
        pending = {r.conn: r for r in self.ranks}
        deadline = time.monotonic() + START_TIMEOUT
        while pending:
            watch = list(pending) + [w for r in pending.values() for w in r.waitables()[1:]]
            ready = wait(watch, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise LaunchError(
                    f"ranks {sorted(r.rank for r in pending.values())} did not start within "
                    f"{START_TIMEOUT:.0f} s (importing torch and joining the group). "
                    f"{self._explain_where(pending.values())}")
            for obj in ready:
                rank = pending.get(obj) or next(r for r in self.ranks if obj in r.waitables())
                try:
                    if isinstance(obj, Connection) and rank.recv()[0] == "ready":
                        pending.pop(obj)
                        continue
                except (EOFError, OSError, plain.PlainDataError):
                    pass
                raise self._died_starting(rank)

    def _died_starting(self, rank: RankProcess) -> LaunchError:
        rank.proc.wait(2.0)
        err = rank.err.take(drain=True).decode(errors="replace")
        tail = "\n".join(err.rstrip().splitlines()[-30:])
        hint = missing_package_hint(err)
        return LaunchError(f"rank {rank.rank} {rank.exit_reason()} while starting "
                           f"({self.backend}, {self.world_size} ranks).{hint}\n{tail}")

    def submit(self, payload: bytes, timeout: float, stream: bool) -> list:
        if self.sandbox is not None:
            payload = _without_sources(payload)
        task_id = next(self._ids)
        cwd, path = os.getcwd(), list(sys.path)
        results: dict[int, object] = {}
        errors: dict[int, dict] = {}
        for r in self.ranks:
            try:
                r.send(("task", task_id, payload, cwd, path))
            except OSError:  # the rank is gone: its exit code says how
                raise self._crashed(r, results) from None
        bar = None
        shown = Shown(self.ranks)
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout(timeout, results, errors, shown)
                live = [r for r in self.ranks if r.rank not in results and r.rank not in errors]
                ready = wait([w for r in live for w in r.waitables()],
                             timeout=min(remaining, 0.1))
                if stream:
                    shown.show(partial=False)
                for r in live:
                    while r.conn in ready and r.conn.poll():
                        try:
                            msg = r.recv()
                        except (EOFError, OSError, plain.PlainDataError):
                            raise self._crashed(r, results, shown=shown) from None
                        if msg[0] == "progress":
                            bar = update_bar(bar, *msg[2:5])
                        elif msg[0] == "done" and msg[1] == task_id:
                            self._answer(r.rank, msg, results, errors)
                            break
                    if r.rank not in results and r.rank not in errors and not r.alive():
                        raise self._crashed(r, results, shown=shown)
                if errors:
                    self._drain(results, errors, 0.2)
                    # a rank that died is the cause; the others' errors ("connection reset
                    # by peer") are its consequence
                    dead = [r for r in self.ranks if r.rank not in results and not r.alive()]
                    if dead:
                        raise self._crashed(dead[0], results, errors, shown)
                    raise self._failed(errors, results, shown)
        finally:
            if bar is not None:
                bar.close()
        shown.show(partial=True)
        return [self._decode(r, results[r]) for r in range(self.world_size)]

    def _answer(self, rank: int, msg, results, errors) -> None:
        _, _, ok, answer, info = msg
        (results if ok else errors)[rank] = answer
        if not isinstance(info, dict) or not info.get("group", True) or \
                info.get("rss", 0) > WARM_MEMORY_MB * 2**20:
            self.reusable = False

    def _decode(self, rank: int, data):
        if not isinstance(data, bytes):
            raise LaunchError(f"rank {rank} sent back something that is not a result")
        try:
            if self.sandbox is not None:
                return plain.loads(data)
            import cloudpickle

            return cloudpickle.loads(data)
        except Exception as exc:  # a class the caller cannot import, a broken reduce...
            self.reusable = False
            raise LaunchError(f"rank {rank}'s result could not be rebuilt in the caller "
                              f"({type(exc).__name__}: {exc}). Return tensors, numbers, "
                              f"strings or plain lists/dicts of them, or objects whose "
                              f"classes the caller can import.") from None

    # ---------------------------------------------------------------- failure paths

    def _drain(self, results, errors, wait_s: float) -> None:
        """Collect answers that arrive within ``wait_s``: ranks failing together (or
        because of each other) are then all accounted for."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for r in self.ranks:
                while r.rank not in results and r.rank not in errors and r.conn.poll():
                    try:
                        msg = r.recv()
                    except (EOFError, OSError, plain.PlainDataError):
                        break
                    if msg[0] == "done":
                        self._answer(r.rank, msg, results, errors)
            time.sleep(0.02)

    def _others(self, results, errors, exclude=()) -> list[str]:
        """What every other rank was doing: its error, or where it was stuck."""
        stuck = [r for r in self.ranks if r.rank not in results and r.rank not in errors
                 and r.rank not in exclude and r.alive()]
        where = self._where(stuck)
        lines = [f"  rank {r}: raised " + exception_line(error_field(errors[r], "type"),
                                                     first_line(error_field(errors[r], "message")))
                 for r in sorted(errors) if r not in exclude]
        lines += [f"  rank {r}: {w}" for r, w in sorted(where.items())]
        lines += [f"  rank {r}: had finished" for r in sorted(results)]
        return (["", "The other ranks were stopped. They were:"] + sorted(lines)) if lines else []

    def _failed(self, errors, results, shown) -> RankError:
        rank = min(errors)
        e = errors[rank]
        others = self._others(results, errors, exclude=(rank,))
        shown.show(partial=True, wait_s=0.5)
        self.close(graceful=False)
        etype, message, tb = error_field(e, "type"), error_field(e, "message"), error_field(e, "traceback")
        where = own_frame(tb)  # first the error and the caller's line, then the details
        lines = [f"rank {rank} raised {exception_line(etype, message)}{missing_package_hint(message)}",
                 *([f"  at {where}"] if where else []), "", tb.rstrip()] + others
        original = None
        if self.sandbox is None and isinstance(e, dict) and isinstance(e.get("exc"), bytes):
            import cloudpickle

            try:
                original = cloudpickle.loads(e["exc"])
            except Exception:  # its class is not importable here
                original = None
        return RankError("\n".join(lines), rank, etype, tb, original, message)

    def _crashed(self, rank: RankProcess, results, errors=None, shown=None) -> RankCrashed:
        rank.proc.wait(1.0)
        reason = rank.exit_reason()
        code = rank.returncode()
        errors = {r: e for r, e in (errors or {}).items() if r != rank.rank}
        self._drain(results, errors, 0.2)
        others = self._others(results, errors, exclude=(rank.rank,))
        shown = shown or Shown(self.ranks)
        shown.collect(wait_s=0.5)
        last_words = [line.rstrip() for line in shown.lines(rank.rank, "err")[-4:]]
        shown.show(partial=True)
        self.close(graceful=False)
        lines = [f"rank {rank.rank} {reason} during the launch, without an answer."]
        if code == -signal.SIGABRT:
            lines.append("An abort inside the backend usually means the ranks disagreed: they "
                         "called different collectives, or the same one with different sizes "
                         "or dtypes (mismatched shapes across ranks).")
        if last_words:
            lines += ["Its last words (stderr):"] + [f"  {line}" for line in last_words]
        lines += others
        return RankCrashed("\n".join(lines), rank.rank, code)

    def _timeout(self, timeout, results, errors, shown) -> LaunchTimeout:
        stuck = [r for r in self.ranks if r.rank not in results and r.rank not in errors]
        stacks = self._stacks(stuck)
        where = {r.rank: self._status(r) for r in stuck}
        shown.show(partial=True, wait_s=0.2)
        self.close(graceful=False)
        done = sorted(results)
        lines = [f"no answer from rank(s) {[r.rank for r in stuck]} within {timeout:g} s: "
                 f"a deadlock (ranks waiting for each other), or work far slower than the "
                 f"timeout. All ranks were stopped." + (
                     f" Ranks {done} had finished." if done else "")]
        for r in stuck:
            lines += ["", f"rank {r.rank}: {where[r.rank]}", indent(stacks[r.rank])]
        return LaunchTimeout("\n".join(lines), timeout, where, stacks)

    def _where(self, ranks) -> dict[int, str]:
        stacks = self._stacks(ranks)
        return {r.rank: f"{self._status(r)}; at {innermost(stacks[r.rank])}" for r in ranks}

    def _status(self, r: RankProcess) -> str:
        """Where the rank stands, from its status board. The file sits in the rank's
        folder (the student's, when grading): opened as a stack file is (:func:`_open_own`),
        read with pread, never mapped (a file truncated under a mapping kills its reader
        with SIGBUS), at most one board's bytes."""
        from distlab.comm import StatusBoard

        text = ""
        try:
            fd = _open_own(r.status_path)
        except OSError:
            fd = None
        if isinstance(fd, int):
            try:
                for _ in range(100):  # a post torn by the writer reads "": read again
                    text = StatusBoard.read(os.pread(fd, StatusBoard.SIZE, 0), attempts=1)
                    if text:
                        break
            except (OSError, ValueError):
                pass
            finally:
                os.close(fd)
        elif fd is not None:
            text = "unknown: its status file is not a regular file"
        now = time.time()
        text = re.sub(r" since (\d+(?:\.\d+)?)$", lambda m: f" for {now - float(m.group(1)):.1f} s",
                      text)
        text = re.sub(r" at (\d+(?:\.\d+)?)$", lambda m: f", {now - float(m.group(1)):.1f} s ago",
                      text)
        if text.startswith("in "):
            return "waiting in " + text[3:]
        if text.startswith("after "):
            return "computing, last call " + text[6:]
        return text or "starting"

    def _stacks(self, ranks) -> dict[int, str]:
        """Each rank's Python stack, dumped by faulthandler on SIGUSR1. The rank's folder
        belongs to the rank's user (a student's code, when grading): its stack file is
        opened without following links and without blocking, read only if it is a
        regular file, and at most ``limit`` bytes of it."""
        import stat

        limit = 1 << 20

        def size(path) -> int:
            try:
                st = os.lstat(path)
            except OSError:
                return 0
            return st.st_size if stat.S_ISREG(st.st_mode) else 0

        def read(path, offset) -> str:
            fd = _open_own(path)
            if not isinstance(fd, int):
                return "(no stack: the rank's stack file is not a regular file)"
            try:
                return os.pread(fd, limit, offset).decode(errors="replace")
            finally:
                os.close(fd)

        sizes = {}
        for r in ranks:
            sizes[r.rank] = size(r.stack_path)
            r.signal(signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + 1.0
        for r in ranks:
            while time.monotonic() < deadline and r.alive() and size(r.stack_path) <= sizes[r.rank]:
                time.sleep(0.02)
            time.sleep(0.02)
            try:
                stacks[r.rank] = tidy_stack(read(r.stack_path, sizes[r.rank]))
            except OSError:
                stacks[r.rank] = "(no stack: the process is gone)"
        return stacks

    def _explain_where(self, ranks) -> str:
        return "; ".join(f"rank {r.rank}: {self._status(r)}" for r in ranks)

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: ask them to leave the group (``graceful``), then kill every one
        before waiting on any. Idempotent; a second interrupt cannot leave ranks alive."""
        if self.closed:
            return
        self.closed = True
        ranks, self.ranks = self.ranks, []
        try:
            if graceful:
                for r in ranks:
                    with contextlib.suppress(OSError, ValueError):
                        r.send(("exit",))
                wait_exit(ranks, 2.0)
            if self.sandbox is not None:  # a confined rank's relay ends its PID namespace on
                for r in ranks:           # SIGTERM and exits once every process in it is gone
                    r.signal(signal.SIGTERM)
                wait_exit(ranks, 2.0)
        finally:
            with _interrupts_deferred():
                for r in ranks:
                    r.kill()
                deadline = time.monotonic() + 5.0
                for r in ranks:
                    r.terminate(deadline)
                shutil.rmtree(self.workdir, ignore_errors=True)
                os.close(self._lock)
