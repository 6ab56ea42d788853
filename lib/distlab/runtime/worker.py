"""A rank process kept warm by :mod:`distlab.launch`.

It joins the process group once, then runs the functions the launcher sends it, one
launch after another, and answers each with the result or the error. The launcher
owns its life: the worker dies with its parent (PR_SET_PDEATHSIG on Linux, and EOF on
its channel everywhere), and dumps its Python stack on SIGUSR1 so that a hang can be
explained.

Everything the worker sends the launcher is plain data (:mod:`distlab.runtime.plain`), so a
rank running untrusted code cannot make the launcher run code. Results themselves
travel pickled (cloudpickle, any object) unless the pool is a sandbox
(``DISTLAB_PLAIN=1``, the autograder), where they are plain data too. Output goes
straight to the launcher's pipes; the end of a launch is signalled on the channel,
never in the output stream.
"""
from __future__ import annotations

import ctypes
import faulthandler
import linecache
import mmap
import os
import signal
import sys
import time
import traceback

from distlab.runtime import absent, plain

current: "Task | None" = None  # the launch this process is running, if any


class Task:
    """What a running launch can reach: its id, the rendezvous store, the channel."""

    PROGRESS_INTERVAL = 0.2

    def __init__(self, task_id, store, conn, rank):
        self.task_id, self.store, self.conn, self.rank = task_id, store, conn, rank
        self._last_progress = 0.0

    def progress(self, desc: str, n: int, total: int | None, final: bool = False) -> None:
        """Tell the launcher (rank 0 only) how far a loop has come, a few times a second."""
        now = time.monotonic()
        if self.rank == 0 and (final or now - self._last_progress >= self.PROGRESS_INTERVAL):
            self._last_progress = now
            send(self.conn, ("progress", self.task_id, str(desc), int(n),
                             None if total is None else int(total), bool(final)))


def send(conn, message) -> None:
    conn.send_bytes(plain.dumps(message))


def rank_files(workdir: str, rank: int) -> dict[str, str]:
    """The files rank ``rank`` writes in its pool's folder ``workdir``: its status board,
    its stack dumps (both read by the launcher) and the rendezvous store all the ranks
    share. A graded rank writes nothing else there (:mod:`distlab.runtime.confine`)."""
    return {"status": os.path.join(workdir, f"status-{rank}"),
            "stack": os.path.join(workdir, f"stack-{rank}.txt"),
            "store": os.path.join(workdir, "store")}


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us with the parent
    except (OSError, AttributeError):  # not Linux: EOF on the channel still ends us
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _to_cpu(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def describe_error(exc: BaseException, skip_frames: int = 1, with_object: bool = True) -> dict:
    """A plain account of ``exc``: type, message, traceback without our frames, and (when
    ``with_object``) the exception itself pickled, for a caller that trusts this process."""
    tb = traceback.TracebackException.from_exception(exc)
    tb.stack = traceback.StackSummary.from_list(list(tb.stack)[skip_frames:])
    original = None
    if with_object:
        import cloudpickle

        try:
            original = cloudpickle.dumps(exc)
        except Exception:  # an exception that cannot travel still has its text
            pass
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(tb.format()), "exc": original}


def _run(task: Task, payload: bytes, sandbox: bool) -> tuple:
    import cloudpickle

    global current
    current = task
    try:
        data, sources = cloudpickle.loads(payload)
        for filename, lines in sources.items():  # notebook cells have no file to read
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        fn, args, kwargs = cloudpickle.loads(data)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # the student's code may raise anything, even SystemExit
        return False, describe_error(exc, skip_frames=1, with_object=not sandbox)
    finally:
        current = None
    try:
        return True, (plain.dumps if sandbox else cloudpickle.dumps)(_to_cpu(result))
    except Exception as exc:
        allowed = ("Return tensors, numbers, strings or lists/tuples/dicts of them." if sandbox
                   else "Return tensors, numbers, strings or plain lists/dicts of them.")
        return False, {"type": "UnpicklableResult", "exc": None, "traceback": "",
                       "message": f"the function returned a {type(result).__name__}, which "
                                  f"cannot be sent back to the launcher ({exc}). {allowed}"}


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main() -> None:
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    _die_with_parent(int(env["DISTLAB_PARENT_PID"]))
    from multiprocessing.connection import Connection

    conn = Connection(int(env["DISTLAB_FD"]))
    files = rank_files(env["DISTLAB_DIR"], rank)
    sandbox = env.get("DISTLAB_PLAIN") == "1"
    stacks = open(files["stack"], "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    with open(files["status"], "r+b") as f:
        board_buffer = mmap.mmap(f.fileno(), 0)

    import torch
    import torch.distributed as dist

    from distlab import comm

    torch.set_num_threads(1)
    board = comm.StatusBoard(board_buffer)
    comm.install()
    comm.post_status_to(board)
    backend = env["DISTLAB_BACKEND"]
    # the rendezvous: a file in the pool's own directory (ranks share one host), so no
    # port is picked and parallel launches cannot collide
    store = dist.FileStore(files["store"], world_size)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(env["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    board.post("joining the process group")
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size, device_id=device)
    board.post("idle")
    send(conn, ("ready", rank, os.getpid()))

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "exit":
            break
        _, task_id, payload, cwd, path = msg
        sys.path[:] = path
        try:
            os.chdir(cwd)
        except OSError:
            pass
        board.post("running the launched function")
        task = Task(task_id, dist.PrefixStore(f"task{task_id}", store), conn, rank)
        ok, answer = _run(task, payload, sandbox)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # the function closed or replaced it
                pass
        board.post("idle")
        group_kept = dist.is_initialized()
        send(conn, ("done", task_id, ok, answer,
                    {"rss": _resident_bytes(), "group": group_kept}))
        if not group_kept:  # the function left the group: this rank cannot be reused
            break
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    absent.install_from_env("modules")  # a fresh interpreter, no fork server: before main
    main()
