"""Run a function on N ranks: from a notebook cell, a script, a test, or under torchrun.

    >>> from distlab import launch
    >>> def hello():
    ...     return dist.get_rank()
    >>> launch.run(hello, 4)
    [0, 1, 2, 3]

Each rank is a process of its own with one GPU under NCCL/RCCL, or one CPU thread under
gloo, joined into the default process group before the function runs. The function
may be defined in a notebook cell: it travels by value (cloudpickle), so no
``%%writefile`` is needed. Each rank's printed output comes back after the launch,
grouped by rank (``stream=True`` prints it as it comes).

Ranks stay warm between launches: the next ``run`` with the same world size and
backend reuses them (about 0.1 s instead of several seconds to start Python and
torch and rendezvous). Any failure, hang or interrupt throws the pool away, and
``isolated=True`` runs one launch on fresh processes.

Failures never hang the caller:

* a rank that raises → :class:`RankError` with its rank and remote traceback; the
  other ranks are stopped at once, and the error says where they were;
* a rank that dies (a signal, ``os._exit``) → :class:`RankCrashed`;
* no result within ``timeout`` seconds (a deadlock) → :class:`LaunchTimeout`, with each
  rank's Python stack and the collective it was in;
* Ctrl-C / interrupting the kernel stops every rank.

Under ``torchrun`` (or inside a launched function) ``run`` calls the function once in
the current process, as this rank, and returns every rank's result, so lab code runs
unchanged on a cluster.
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait

from distlab import backend as backends

DEFAULT_TIMEOUT = 120.0  # seconds a launch may take before it is declared hung
START_TIMEOUT = 120.0    # seconds for fresh ranks to import torch and rendezvous


class LaunchError(RuntimeError):
    """A launch that returned no results."""


class RankError(LaunchError):
    """A rank raised. ``original`` is the rank's exception, where it could travel."""

    def __init__(self, message, rank, exc_type, remote_traceback, original=None):
        super().__init__(message)
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback
        self.original = original


class RankCrashed(LaunchError):
    """A rank process died without an answer (killed by a signal, or exited)."""

    def __init__(self, message, rank, returncode):
        super().__init__(message)
        self.rank, self.returncode = rank, returncode


class LaunchTimeout(LaunchError):
    """No answer from every rank within the timeout: a deadlock, or far too slow.

    ``where`` maps each unfinished rank to the collective it was in; ``stacks`` to its
    Python stack.
    """

    def __init__(self, message, timeout, where, stacks):
        super().__init__(message)
        self.timeout, self.where, self.stacks = timeout, where, stacks


# --------------------------------------------------------------------------- the API


def run(fn, world_size: int, *args, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT,
        isolated: bool = False, stream: bool = False, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    ``backend``: "auto" (NCCL/RCCL when every rank can have its own GPU, else gloo),
    "nccl", "rccl" or "gloo". ``timeout``: seconds before the launch is declared hung.
    ``isolated``: fresh processes for this launch instead of the warm pool.
    ``stream``: print each rank's output as it arrives rather than grouped at the end.
    Tensors in the results come back on the CPU.
    """
    if not callable(fn):
        raise TypeError(f"run() needs a function to call, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (the number of ranks), "
                         f"got {world_size!r}")
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if _in_running_group():
        return _run_here(fn, world_size, args, kwargs)
    name = backends.choose(world_size, backend)
    payload = _pack(fn, args, kwargs)
    if isolated:
        pool = _Pool(world_size, name)
        try:
            return pool.submit(payload, timeout, stream)
        finally:
            pool.close()
    pool = _warm_pool(world_size, name)
    try:
        return pool.submit(payload, timeout, stream)
    except BaseException:  # a failure, a hang or an interrupt: never reuse these ranks
        shutdown(graceful=False)
        raise


def shutdown(graceful: bool = True) -> None:
    """Stop the warm ranks, if any (they also stop when Python exits)."""
    global _pool
    if _pool is not None:
        _pool.close(graceful)
        _pool = None


def progress(iterable, total: int | None = None, desc: str = ""):
    """Wrap a loop in a launched function: rank 0 drives a progress bar in the notebook
    (tqdm) while the other ranks iterate silently. Works under torchrun too.

    In a notebook the bar is tqdm's widget while the loop runs; when it ends the widget
    gives way to one plain line with the final count (see :class:`_Bar`), which is what
    a stored notebook then shows."""
    from distlab import worker

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    task = worker.current
    if task is not None:
        return _reported(iterable, total, desc, task)
    if _rank() != 0:
        return iter(iterable)
    return _drawn(iterable, total, desc)


def store():
    """The key-value store every rank of this launch shares (e.g. for an NCCL unique id)."""
    from distlab import worker

    if worker.current is not None:
        return worker.current.store
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


# ------------------------------------------------------------------ in-process (torchrun)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(
        os.environ) and "DISTLAB_WORKER" not in os.environ


def _in_running_group() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or _under_torchrun()


def _run_here(fn, world_size, args, kwargs) -> list:
    import torch
    import torch.distributed as dist

    from distlab import worker

    if not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        name = backends.choose(per_node, "auto")
        device = backends.device_for(local, name) if name == "nccl" else None
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(name, device_id=device)
        # leave the group before interpreter teardown, or gloo's threads abort the process
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if dist.get_world_size() != world_size:
        raise LaunchError(
            f"this launch asks for {world_size} ranks but the running group has "
            f"{dist.get_world_size()} (torchrun --nproc-per-node); start torchrun with "
            f"{world_size} processes or pass world_size={dist.get_world_size()}")
    result = worker._to_cpu(fn(*args, **kwargs))
    results = [None] * world_size
    dist.all_gather_object(results, result)
    return results


# -------------------------------------------------------------------------- the pool


def _pack(fn, args, kwargs) -> bytes:
    """Pickle the call by value, keeping each function's file name and sending the
    source of the cells it came from, so that a rank's traceback shows the lines."""
    import io
    import linecache
    import types
    from collections import ChainMap

    import cloudpickle

    files: set[str] = set()

    def reduce_code(code):
        files.add(code.co_filename)
        ctor, fields = cloudpickle.cloudpickle._code_reduce(code)
        return ctor, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table)

    buffer = io.BytesIO()
    try:
        Pickler(buffer).dump((fn, args, kwargs))
    except Exception as exc:
        raise LaunchError(
            f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
            f"{exc}. Pass tensors, numbers and plain containers; open files, locks and "
            f"live process groups cannot travel.") from exc
    sources = {f: linecache.getlines(f) for f in files}
    return cloudpickle.dumps((buffer.getvalue(), {f: lines for f, lines in sources.items() if lines}))


_pool: "_Pool | None" = None


def _warm_pool(world_size: int, name: str) -> "_Pool":
    global _pool
    if _pool is not None and (_pool.world_size, _pool.backend) != (world_size, name):
        shutdown()
    if _pool is None:
        _pool = _Pool(world_size, name)
    return _pool


atexit.register(shutdown)


class _Spawned:
    """A rank started as a fresh interpreter, where forking after torch is unsafe (macOS).
    Same interface as :class:`distlab.forkserver.Child`."""

    def __init__(self, env: dict, channel: int, stdout: int, stderr: int):
        env = dict(env, DISTLAB_FD=str(channel), DISTLAB_PARENT_PID=str(os.getpid()),
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "distlab.worker"], env=env,
                                     pass_fds=[channel], stdin=subprocess.DEVNULL,
                                     stdout=stdout, stderr=stderr, start_new_session=True)
        self.pid = self.proc.pid
        self.fd, done = os.pipe()
        threading.Thread(target=lambda: (self.proc.wait(), os.close(done)), daemon=True).start()

    def fileno(self) -> int:
        return self.fd

    def wait(self, timeout: float | None = None) -> bool:
        return bool(select.select([self.fd], [], [], timeout)[0])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def returncode(self) -> int:
        return self.proc.wait()

    def close(self) -> None:
        os.close(self.fd)


_forkserver = None


def _start(env: dict, channel: int, stdout: int, stderr: int):
    """A rank process: forked by the warm fork server on Linux, a fresh Python elsewhere."""
    global _forkserver
    if sys.platform != "linux":
        return _Spawned(env, channel, stdout, stderr)
    from distlab.forkserver import ForkServer

    if _forkserver is None or not _forkserver.alive():
        _forkserver = ForkServer()
    return _forkserver.spawn(env, channel, stdout, stderr)


class _Output:
    """A rank's stdout or stderr, cut into segments at each MARK line: segment 0 is the
    start-up, segment k the output of the pool's k-th launch."""

    def __init__(self, pipe):
        self.segments: list[list[str]] = [[]]
        self.closed = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        from distlab.worker import MARK

        for line in iter(pipe.readline, ""):
            with self.cond:
                if line.rstrip("\n") == MARK:
                    self.segments.append([])
                    self.cond.notify_all()
                else:
                    self.segments[-1].append(line)
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def lines(self, index: int, start: int = 0, wait_s: float = 0.0) -> list[str]:
        """Lines ``start:`` of segment ``index``, waiting up to ``wait_s`` for it to end."""
        with self.cond:
            if wait_s:
                self.cond.wait_for(lambda: len(self.segments) > index + 1 or self.closed, wait_s)
            return list(self.segments[index][start:]) if index < len(self.segments) else []


class _Rank:
    """One rank process of a pool: its channel, its output, its status board."""

    def __init__(self, rank, world_size, name, workdir):
        from distlab.comm import StatusBoard

        self.rank = rank
        with open(os.path.join(workdir, f"status-{rank}"), "wb") as f:
            f.write(b"\0" * StatusBoard.SIZE)
        self.stackfile = os.path.join(workdir, f"stack-{rank}.txt")
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), DISTLAB_WORKER="1",
                   DISTLAB_BACKEND=name, DISTLAB_DIR=workdir,
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for key in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = _start(env, theirs.fileno(), out_w, err_w)
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        self.conn = Connection(ours.detach())
        self.out = _Output(open(out_r, encoding="utf-8", errors="replace"))
        self.err = _Output(open(err_r, encoding="utf-8", errors="replace"))

    def alive(self) -> bool:
        return self.proc.alive()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.proc.close()

    def exit_reason(self) -> str:
        code = self.proc.returncode()
        if code < 0:
            return f"was killed by {signal.Signals(-code).name} (signal {-code})"
        return f"exited with status {code}"


class _Pool:
    """``world_size`` rank processes joined in one process group, reused across launches."""

    _ids = itertools.count()

    def __init__(self, world_size: int, name: str):
        self.world_size, self.backend = world_size, name
        self.workdir = tempfile.mkdtemp(prefix="distlab-")
        self.tasks = 0  # launches run so far; output segment k+1 belongs to launch k
        self.ranks: list[_Rank] = []
        try:
            for r in range(world_size):
                self.ranks.append(_Rank(r, world_size, name, self.workdir))
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        pending = {r.conn: r for r in self.ranks}
        deadline = time.monotonic() + START_TIMEOUT
        while pending:
            ready = wait(list(pending) + [r.proc for r in self.ranks],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise LaunchError(
                    f"ranks {sorted(r.rank for r in pending.values())} did not start within "
                    f"{START_TIMEOUT:.0f} s (importing torch and joining the group). "
                    f"{self._explain_where(pending.values())}")
            for obj in ready:
                if not isinstance(obj, Connection):
                    rank = next(r for r in self.ranks if r.proc is obj)
                    err = "".join(rank.err.lines(0, wait_s=2.0)[-30:])
                    hint = _missing_package_hint(err)
                    raise LaunchError(f"rank {rank.rank} {rank.exit_reason()} while starting "
                                      f"({self.backend}, {self.world_size} ranks).{hint}\n{err}")
                rank = pending.pop(obj)
                obj.recv()

    def submit(self, payload: bytes, timeout: float, stream: bool) -> list:
        task_id = next(self._ids)
        self.tasks += 1
        segment = self.tasks
        cwd, path = os.getcwd(), list(sys.path)
        for r in self.ranks:
            r.conn.send(("task", task_id, payload, cwd, path))
        results: dict[int, object] = {}
        errors: dict[int, dict] = {}
        bar = None
        printed: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout(timeout, segment, results, errors)
                live = [r for r in self.ranks if r.rank not in results and r.rank not in errors]
                ready = wait([r.conn for r in live] + [r.proc for r in live],
                             timeout=min(remaining, 0.1))
                if stream:
                    self._print_output(segment, printed, wait_s=0.0)
                for r in live:
                    while r.conn in ready and r.conn.poll():
                        try:
                            msg = r.conn.recv()
                        except (EOFError, OSError):  # the rank is gone: its exit code says how
                            raise self._crashed(r, segment, results) from None
                        if msg[0] == "progress":
                            bar = _update_bar(bar, *msg[2:])
                        elif msg[1] == task_id:
                            (results if msg[2] else errors)[r.rank] = msg[3]
                            break
                    if r.proc in ready and r.rank not in results and r.rank not in errors:
                        raise self._crashed(r, segment, results)
                if errors:
                    self._drain(results, errors, 0.2)
                    # a rank that died is the cause; the others' errors ("connection reset
                    # by peer") are its consequence
                    dead = [r for r in self.ranks if r.rank not in results and not r.alive()]
                    if dead:
                        raise self._crashed(dead[0], segment, results, errors)
                    raise self._failed(errors, segment, results)
        finally:
            if bar is not None:
                bar.close()
        self._print_output(segment, printed)
        return [_unpack(results[r]) for r in range(self.world_size)]

    # ---------------------------------------------------------------- failure paths

    def _drain(self, results, errors, wait_s: float) -> None:
        """Collect answers that arrive within ``wait_s``: ranks failing together (or
        because of each other) are then all accounted for."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for r in self.ranks:
                while r.rank not in results and r.rank not in errors and r.conn.poll():
                    try:
                        msg = r.conn.recv()
                    except (EOFError, OSError):
                        break
                    if msg[0] == "done":
                        (results if msg[2] else errors)[r.rank] = msg[3]
            time.sleep(0.02)

    def _others(self, results, errors, exclude=()) -> list[str]:
        """What every other rank was doing: its error, or where it was stuck."""
        stuck = [r for r in self.ranks if r.rank not in results and r.rank not in errors
                 and r.rank not in exclude and r.alive()]
        where = self._where(stuck)
        lines = [f"  rank {r}: raised {errors[r]['type']}: {_first_line(errors[r]['message'])}"
                 for r in sorted(errors) if r not in exclude]
        lines += [f"  rank {r}: {w}" for r, w in sorted(where.items())]
        lines += [f"  rank {r}: had finished" for r in sorted(results)]
        return (["", "The other ranks were stopped. They were:"] + sorted(lines)) if lines else []

    def _failed(self, errors, segment, results) -> RankError:
        rank = min(errors)
        e = errors[rank]
        others = self._others(results, errors, exclude=(rank,))
        self._print_output(segment, wait_s=0.5)
        self.close(graceful=False)
        lines = [f"rank {rank} raised {e['type']}: {e['message']}"
                 f"{_missing_package_hint(e['message'])}", "", e["traceback"].rstrip()] + others
        original = None
        if e.get("exc"):
            import cloudpickle

            try:
                original = cloudpickle.loads(e["exc"])
            except Exception:  # its class is not importable here
                original = None
        return RankError("\n".join(lines), rank, e["type"], e["traceback"], original)

    def _crashed(self, rank: _Rank, segment, results, errors=None) -> RankCrashed:
        reason = rank.exit_reason()
        errors = {r: e for r, e in (errors or {}).items() if r != rank.rank}
        self._drain(results, errors, 0.2)
        others = self._others(results, errors, exclude=(rank.rank,))
        last_words = [line.rstrip() for line in rank.err.lines(segment, wait_s=0.5)[-4:]]
        self._print_output(segment, wait_s=0.5)
        self.close(graceful=False)
        lines = [f"rank {rank.rank} {reason} during the launch, without an answer."]
        if rank.proc.returncode() == -signal.SIGABRT:
            lines.append("An abort inside the backend usually means the ranks disagreed: they "
                         "called different collectives, or the same one with different sizes "
                         "or dtypes (mismatched shapes across ranks).")
        if last_words:
            lines += ["Its last words (stderr):"] + [f"  {line}" for line in last_words]
        lines += others
        return RankCrashed("\n".join(lines), rank.rank, rank.proc.returncode())

    def _timeout(self, timeout, segment, results, errors) -> LaunchTimeout:
        stuck = [r for r in self.ranks if r.rank not in results and r.rank not in errors]
        stacks = self._stacks(stuck)
        where = {r.rank: self._status(r) for r in stuck}
        self._print_output(segment, wait_s=0.2)
        self.close(graceful=False)
        done = sorted(results)
        lines = [f"no answer from rank(s) {[r.rank for r in stuck]} within {timeout:g} s: "
                 f"a deadlock (ranks waiting for each other), or work far slower than the "
                 f"timeout. All ranks were stopped." + (
                     f" Ranks {done} had finished." if done else "")]
        for r in stuck:
            lines += ["", f"rank {r.rank}: {where[r.rank]}", _indent(stacks[r.rank])]
        return LaunchTimeout("\n".join(lines), timeout, where, stacks)

    def _where(self, ranks) -> dict[int, str]:
        stacks = self._stacks(ranks)
        return {r.rank: f"{self._status(r)}; at {_innermost(stacks[r.rank])}" for r in ranks}

    def _status(self, r: _Rank) -> str:
        from distlab.comm import StatusBoard

        with open(os.path.join(self.workdir, f"status-{r.rank}"), "rb") as f:
            text = StatusBoard.read(f.read())
        now = time.time()
        text = re.sub(r" since ([\d.]+)$", lambda m: f" for {now - float(m.group(1)):.1f} s", text)
        text = re.sub(r" at ([\d.]+)$", lambda m: f", {now - float(m.group(1)):.1f} s ago", text)
        if text.startswith("in "):
            return "waiting in " + text[3:]
        if text.startswith("after "):
            return "computing, last call " + text[6:]
        return text or "starting"

    def _stacks(self, ranks) -> dict[int, str]:
        """Each rank's Python stack, dumped by faulthandler on SIGUSR1."""
        sizes = {}
        for r in ranks:
            sizes[r.rank] = os.path.getsize(r.stackfile) if os.path.exists(r.stackfile) else 0
            if r.alive():
                os.kill(r.proc.pid, signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + 1.0
        for r in ranks:
            while time.monotonic() < deadline and r.alive() and (
                    not os.path.exists(r.stackfile) or os.path.getsize(r.stackfile) <= sizes[r.rank]):
                time.sleep(0.02)
            time.sleep(0.02)
            try:
                with open(r.stackfile) as f:
                    f.seek(sizes[r.rank])
                    stacks[r.rank] = _tidy_stack(f.read())
            except OSError:
                stacks[r.rank] = "(no stack: the process is gone)"
        return stacks

    def _explain_where(self, ranks) -> str:
        return "; ".join(f"rank {r.rank}: {self._status(r)}" for r in ranks)

    # ---------------------------------------------------------------------- output

    def _print_output(self, segment: int, printed: dict | None = None,
                      wait_s: float = 5.0) -> None:
        """Print the ranks' output of launch ``segment`` not yet printed, grouped by rank.

        ``printed`` counts the lines already shown per (rank, stream) and is updated;
        ``wait_s`` > 0 waits for each rank's end-of-launch mark first."""
        printed = {} if printed is None else printed
        for name, target in (("out", sys.stdout), ("err", sys.stderr)):
            for r in self.ranks:
                key = (r.rank, name)
                new = getattr(r, name).lines(segment, printed.get(key, 0), wait_s)
                printed[key] = printed.get(key, 0) + len(new)
                for line in new:
                    target.write(f"[rank {r.rank}] {line}")
            target.flush()

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: ask them to leave the group (``graceful``), then kill."""
        for r in self.ranks if graceful else ():
            if r.alive():
                try:
                    r.conn.send(("exit",))
                except OSError:
                    pass
        deadline = time.monotonic() + (2.0 if graceful else 0.0)
        for r in self.ranks:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
            r.kill()
        self.ranks = []
        shutil.rmtree(self.workdir, ignore_errors=True)


# ------------------------------------------------------------------------- helpers


def _unpack(data: bytes):
    import cloudpickle

    return cloudpickle.loads(data)


def _reported(iterable, total, desc, task):
    n = 0
    for item in iterable:
        yield item
        n += 1
        task.progress(desc, n, total)
    task.progress(desc, n, total, final=True)


def _drawn(iterable, total, desc):
    bar = _Bar(desc, total)
    try:
        for n, item in enumerate(iterable, 1):
            yield item
            bar.update(n)
    finally:
        bar.close()


def _update_bar(bar, desc, n, total):
    if bar is None or bar.desc != desc:
        if bar is not None:
            bar.close()
        bar = _Bar(desc, total)
    bar.update(n)
    return bar


class _Bar:
    """A progress bar in the caller: tqdm's text bar in a terminal, its widget in a
    notebook.

    A notebook stores a widget's output as it was first drawn ("0%"), and that is what
    GitHub and other static views show. So in a notebook the widget is displayed with no
    text of its own, and when the bar closes it is replaced by nothing and its final
    state is printed as a plain line, without timings: ``desc: 100%|██████████| 600/600``.
    A re-run prints the same line (nbval compares it; it skips the widget's view)."""

    WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

    def __init__(self, desc: str, total: int | None):
        from tqdm.auto import tqdm

        self.desc, self.handle = desc, None
        if "tqdm.notebook" not in {cls.__module__ for cls in tqdm.__mro__}:
            self.tqdm = tqdm(total=total, desc=desc)  # a terminal, or no ipywidgets
            return
        from IPython.display import display

        self.tqdm = tqdm(total=total, desc=desc, display=False)
        view = {"version_major": 2, "version_minor": 0, "model_id": self.tqdm.container.model_id}
        self.handle = display({self.WIDGET_VIEW: view}, raw=True, display_id=True)

    def update(self, n: int) -> None:
        self.tqdm.update(n - self.tqdm.n)

    def close(self) -> None:
        self.tqdm.close()
        if self.handle is None:
            return
        self.handle.update({}, raw=True)
        self.tqdm.container.close()
        n, total = self.tqdm.n, self.tqdm.total
        print(self.tqdm.format_meter(n, total, 0, prefix=self.desc,
                                     bar_format="{l_bar}{bar:10}| {n_fmt}/{total_fmt}")
              if total else f"{self.desc}: {n}it")


_PACKAGE_FOR = {"cupy": "cupy-cuda13x (or: pip install -e '.[gpu]')", "cv2": "opencv-python",
                "yaml": "pyyaml", "sklearn": "scikit-learn", "PIL": "pillow"}


def _missing_package_hint(text: str) -> str:
    m = re.search(r"No module named '([\w.]+)'", text)
    if not m:
        return ""
    top = m.group(1).split(".")[0]
    return (f"\nThe package {top!r} is missing in the environment the ranks run in "
            f"({sys.executable}). Install it: {sys.executable} -m pip install "
            f"{_PACKAGE_FOR.get(top, top)}")


def _tidy_stack(text: str) -> str:
    """faulthandler's dump, without the launcher's own frames."""
    keep = [line for line in text.splitlines() if line.strip() and not _machinery(line)]
    return "\n".join(keep) or "(empty stack)"


def _machinery(frame: str) -> bool:
    return any(part in frame for part in (
        "distlab/worker.py", "distlab/comm.py", "<frozen runpy>", "c10d_logger.py"))


def _innermost(stack: str) -> str:
    """The innermost frame of the user's own code (not torch's, not the launcher's)."""
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File")]
    own = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]
    return (own or frames or ["(unknown)"])[0]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
