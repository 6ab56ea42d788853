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
backend reuses them (about a millisecond instead of seconds to start Python and torch
and rendezvous). Any failure, hang or interrupt throws the pool away, and
``isolated=True`` runs one launch on fresh processes. Launches from several threads
take turns on the warm ranks. A rank that keeps more than
``DISTLAB_WARM_MEMORY_MB`` (default 4096) MiB resident after a launch, or whose
function left the process group (``dist.destroy_process_group()``), is not reused.

Failures never hang the caller:

* a rank that raises → :class:`RankError` with its rank and remote traceback; the
  other ranks are stopped at once, and the error says where they were;
* a rank that dies (a signal, ``os._exit``) → :class:`RankCrashed`;
* no result within ``timeout`` seconds (a deadlock) → :class:`LaunchTimeout`, with each
  rank's Python stack and the collective it was in;
* Ctrl-C / interrupting the kernel stops every rank.

Under ``torchrun`` (or inside a launched function, or with ``DISTLAB_IN_PROCESS=1``
under another launcher) ``run`` calls the function once in the current process, as
this rank, and returns every rank's result, so lab code runs unchanged on a cluster.
There ``backend`` and ``timeout`` apply when ``run`` creates the process group (the
timeout then bounds every collective); a group the caller made keeps its own.

Sandbox (the autograder, ``DISTLAB_SANDBOX=1``): results come back as plain data
(:mod:`distlab.plain`), never unpickled, and where the caller is root the ranks run as
the unprivileged user ``DISTLAB_SANDBOX_USER`` ("uid:gid").
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import numbers
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait

from distlab import backend as backends
from distlab import plain
from distlab.forkserver import ForkServerError
from distlab.rankproc import RankProcess, wait_exit

DEFAULT_TIMEOUT = 120.0  # seconds a launch may take before it is declared hung
START_TIMEOUT = 120.0    # seconds for fresh ranks to import torch and rendezvous
WARM_MEMORY_MB = float(os.environ.get("DISTLAB_WARM_MEMORY_MB", 4096))


class LaunchError(RuntimeError):
    """A launch that returned no results."""


class RankError(LaunchError):
    """A rank raised. ``exc_type`` and ``message`` are its exception's class name and text;
    ``original`` is the exception itself, where it could travel (never in a sandbox)."""

    def __init__(self, text, rank, exc_type, remote_traceback, original=None, message=""):
        super().__init__(text)
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback
        self.original, self.message = original, message


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
    _check_timeout(timeout)
    if _in_running_group():
        return _run_here(fn, world_size, args, kwargs, backend, timeout)
    name = backends.choose(world_size, backend)
    payload = _pack(fn, args, kwargs)
    sandbox = _sandbox()
    if isolated:
        pool = _Pool(world_size, name, sandbox)
        try:
            return pool.submit(payload, timeout, stream)
        finally:
            pool.close()
    if not _pool_lock.acquire(timeout=timeout):
        raise LaunchError(f"another thread's launch kept the warm ranks busy for {timeout:g} s; "
                          f"pass isolated=True to launch on ranks of this thread's own")
    try:
        pool = _warm_pool(world_size, name, sandbox)
        try:
            results = pool.submit(payload, timeout, stream)
        except BaseException:  # a failure, a hang or an interrupt: never reuse these ranks
            shutdown(graceful=False)
            raise
        if not pool.reusable:
            shutdown()
        return results
    finally:
        _pool_lock.release()


def shutdown(graceful: bool = True) -> None:
    """Stop the warm ranks, if any (they also stop when Python exits)."""
    global _pool
    locked = _pool_lock.acquire(timeout=10)
    try:
        pool, _pool = _pool, None
        if pool is not None:
            pool.close(graceful)
    finally:
        if locked:
            _pool_lock.release()


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
    """torchrun sets TORCHELASTIC_RUN_ID; other launchers (mpirun, a Kubeflow pod that sets
    RANK, WORLD_SIZE and MASTER_ADDR for its own purposes) are not taken for one unless
    DISTLAB_IN_PROCESS=1 says so."""
    env = os.environ
    return "DISTLAB_WORKER" not in env and (
        "TORCHELASTIC_RUN_ID" in env or env.get("DISTLAB_IN_PROCESS") == "1")


def _in_running_group() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or _under_torchrun()


def _run_here(fn, world_size, args, kwargs, backend, timeout) -> list:
    import datetime

    import torch
    import torch.distributed as dist

    from distlab import worker

    if not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        name = backends.choose(per_node, backend)
        device = backends.device_for(local, name) if name == "nccl" else None
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(name, device_id=device,
                                timeout=datetime.timedelta(seconds=timeout))
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


def _check_timeout(timeout) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds (for example timeout=60), got "
                        f"{timeout!r} of type {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got "
                         f"{timeout!r}")


def _pack(fn, args, kwargs) -> bytes:
    """Pickle the call by value, keeping each function's file name and sending the
    source of the cells it came from, so that a rank's traceback shows the lines."""
    import importlib
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

        def reducer_override(self, obj):
            # Modules whose class torch replaced (torch.distributed.config, torch.ops) are
            # importable by name, though cloudpickle would try to copy them: a function
            # that merely mentions `config` and uses `dist` drags one in.
            if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                    and sys.modules.get(obj.__name__) is obj):
                return importlib.import_module, (obj.__name__,)
            return super().reducer_override(obj)

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
_pool_lock = threading.RLock()


def _warm_pool(world_size: int, name: str, sandbox) -> "_Pool":
    global _pool
    if _pool is not None and (_pool.world_size, _pool.backend, _pool.sandbox) != (
            world_size, name, sandbox):
        shutdown()
    if _pool is None:
        _pool = _Pool(world_size, name, sandbox)
    return _pool


def _shutdown_at_exit() -> None:
    from distlab.rankproc import stop_forkserver

    shutdown()
    stop_forkserver()


atexit.register(_shutdown_at_exit)


def _sandbox() -> tuple | None:
    """None, or (uid, gid) to run as (() for the caller's own user), from DISTLAB_SANDBOX."""
    if os.environ.get("DISTLAB_SANDBOX") != "1":
        return None
    user = os.environ.get("DISTLAB_SANDBOX_USER", "")
    if not user or os.geteuid() != 0:
        return ()
    uid, gid = (int(x) for x in user.split(":"))
    return (uid, gid)


def _new_workdir(run_as) -> tuple[str, int]:
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
    if run_as:
        os.chown(workdir, *run_as)
    return workdir, lock


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


class _Pool:
    """``world_size`` rank processes joined in one process group, reused across launches."""

    _ids = itertools.count()

    def __init__(self, world_size: int, name: str, sandbox=None):
        self.world_size, self.backend, self.sandbox = world_size, name, sandbox
        self.ranks: list[RankProcess] = []
        self.closed = False
        self.reusable = True
        run_as = sandbox or None
        self.workdir, self._lock = _new_workdir(run_as)
        env = dict(os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   DISTLAB_WORKER="1", DISTLAB_BACKEND=name, DISTLAB_DIR=self.workdir,
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for key in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "DISTLAB_SANDBOX",
                    "DISTLAB_SANDBOX_USER", "DISTLAB_IN_PROCESS"):
            env.pop(key, None)
        if sandbox is not None:
            env.update(DISTLAB_PLAIN="1", HOME=self.workdir, TMPDIR=self.workdir)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
        try:
            for r in range(world_size):
                self.ranks.append(RankProcess(r, dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                              self.workdir, run_as))
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
        hint = _missing_package_hint(err)
        return LaunchError(f"rank {rank.rank} {rank.exit_reason()} while starting "
                           f"({self.backend}, {self.world_size} ranks).{hint}\n{tail}")

    def submit(self, payload: bytes, timeout: float, stream: bool) -> list:
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
        shown = _Shown(self.ranks)
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
                            bar = _update_bar(bar, *msg[2:5])
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
        lines = [f"  rank {r}: raised {_text(errors[r], 'type')}: "
                 f"{_first_line(_text(errors[r], 'message'))}"
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
        etype, message, tb = _text(e, "type"), _text(e, "message"), _text(e, "traceback")
        lines = [f"rank {rank} raised {etype}: {message}{_missing_package_hint(message)}",
                 "", tb.rstrip()] + others
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
        shown = shown or _Shown(self.ranks)
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
            lines += ["", f"rank {r.rank}: {where[r.rank]}", _indent(stacks[r.rank])]
        return LaunchTimeout("\n".join(lines), timeout, where, stacks)

    def _where(self, ranks) -> dict[int, str]:
        stacks = self._stacks(ranks)
        return {r.rank: f"{self._status(r)}; at {_innermost(stacks[r.rank])}" for r in ranks}

    def _status(self, r: RankProcess) -> str:
        import mmap

        from distlab.comm import StatusBoard

        try:
            with open(r.status_path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                                            access=mmap.ACCESS_READ) as m:
                text = StatusBoard.read(m)
        except (OSError, ValueError):
            text = ""
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
        """Each rank's Python stack, dumped by faulthandler on SIGUSR1."""
        sizes = {}
        for r in ranks:
            sizes[r.rank] = os.path.getsize(r.stack_path) if os.path.exists(r.stack_path) else 0
            r.signal(signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + 1.0
        for r in ranks:
            while time.monotonic() < deadline and r.alive() and (
                    not os.path.exists(r.stack_path) or os.path.getsize(r.stack_path) <= sizes[r.rank]):
                time.sleep(0.02)
            time.sleep(0.02)
            try:
                with open(r.stack_path, errors="replace") as f:
                    f.seek(sizes[r.rank])
                    stacks[r.rank] = _tidy_stack(f.read())
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
        finally:
            with _interrupts_deferred():
                for r in ranks:
                    r.kill()
                deadline = time.monotonic() + 5.0
                for r in ranks:
                    r.terminate(deadline)
                shutil.rmtree(self.workdir, ignore_errors=True)
                os.close(self._lock)


# ---------------------------------------------------------------------- output


class _Shown:
    """The output of one launch, per rank and stream, printed grouped by rank and tagged
    ``[rank r]``; what a terminal would show of carriage-return progress lines."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.pending = {(r.rank, s): b"" for r in self.ranks for s in ("out", "err")}
        self.kept = {key: [] for key in self.pending}

    def collect(self, wait_s: float = 0.0) -> None:
        """Read what every rank has written so far (waiting ``wait_s`` for stragglers)."""
        if wait_s:
            time.sleep(wait_s)
        for r in self.ranks:
            for s in ("out", "err"):
                self.pending[r.rank, s] += getattr(r, s).take(drain=True)

    def lines(self, rank: int, stream: str) -> list[str]:
        data = self.pending[rank, stream]
        return self.kept[rank, stream] + data.decode(errors="replace").splitlines()

    def show(self, partial: bool, wait_s: float = 0.0) -> None:
        """Print the complete lines read so far (and a last unfinished one if
        ``partial``), stdout first, grouped by rank."""
        self.collect(wait_s)
        for s, target in (("out", sys.stdout), ("err", sys.stderr)):
            for r in self.ranks:
                data = self.pending[r.rank, s]
                cut = len(data) if partial else data.rfind(b"\n") + 1
                text, self.pending[r.rank, s] = data[:cut].decode(errors="replace"), data[cut:]
                for line in text.splitlines():
                    self.kept[r.rank, s].append(line)
                    target.write(f"[rank {r.rank}] {_as_displayed(line)}\n")
            target.flush()


def _as_displayed(line: str) -> str:
    """A line with carriage returns as a terminal leaves it: the last thing drawn."""
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


# ------------------------------------------------------------------------- helpers


def _text(e, key: str) -> str:
    """A field of a rank's error report, as text whatever the rank sent."""
    value = e.get(key, "") if isinstance(e, dict) else ""
    return value if isinstance(value, str) else repr(value)


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
