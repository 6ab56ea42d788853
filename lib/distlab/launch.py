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
(:mod:`distlab.runtime.plain`), never unpickled, and where the caller is root the ranks run as
the unprivileged user ``DISTLAB_SANDBOX_USER`` ("uid:gid").
"""
from __future__ import annotations

import atexit
import math
import numbers
import os
import sys
import threading

from distlab import backend as backends
from distlab.runtime.errors import LaunchError, LaunchTimeout, RankCrashed, RankError
from distlab.runtime.pool import Pool
from distlab.runtime.report import drawn, reported

__all__ = ["run", "shutdown", "progress", "store", "LaunchError", "LaunchTimeout",
           "RankCrashed", "RankError", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 120.0  # seconds a launch may take before it is declared hung

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
        pool = Pool(world_size, name, sandbox)
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
    gives way to one plain line with the final count (see :class:`Bar`), which is what
    a stored notebook then shows."""
    from distlab.runtime import worker

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    task = worker.current
    if task is not None:
        return reported(iterable, total, desc, task)
    if _rank() != 0:
        return iter(iterable)
    return drawn(iterable, total, desc)


def store():
    """The key-value store every rank of this launch shares (e.g. for an NCCL unique id)."""
    from distlab.runtime import worker

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

    from distlab.runtime import worker

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
    if dist.get_world_size() != world_size and worker.current is not None:
        raise LaunchError(
            f"launch.run(..., {world_size}) was called inside a launched function, on a rank "
            f"of a launch of {dist.get_world_size()} ranks: there run() calls the function "
            f"on the ranks already running (nested launches start no ranks), so the world "
            f"sizes must match. Call the function directly inside the launched one, or call "
            f"launch.run(fn, {world_size}) from the notebook or script, outside any launch")
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


_pool: "Pool | None" = None
_pool_lock = threading.RLock()


def _warm_pool(world_size: int, name: str, sandbox) -> "Pool":
    global _pool
    if _pool is not None and (_pool.world_size, _pool.backend, _pool.sandbox) != (
            world_size, name, sandbox):
        shutdown()
    if _pool is None:
        _pool = Pool(world_size, name, sandbox)
    return _pool


def _shutdown_at_exit() -> None:
    from distlab.runtime.rankproc import stop_forkserver

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
