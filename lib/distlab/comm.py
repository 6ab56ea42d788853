"""Traced communication: every collective and point-to-point call a rank makes.

``install()`` replaces the primitives of ``torch.distributed`` with thin wrappers that
record, while a :class:`CommLog` is active, the op, its message size in bytes, the
peer or root, the group and the start/end time. Code calls ``dist.all_reduce`` as
usual; the launcher installs the wrappers in every rank, and entering a ``CommLog``
installs them anywhere else (under torchrun, say). Collectives that torch issues from
C++ (the reducer inside ``DistributedDataParallel``) bypass Python and are not seen.

Message sizes follow nccl-tests: the whole buffer of an all-reduce, broadcast or
reduce; the *output* of an all-gather; the *input* of a reduce-scatter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import threading
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distlab.collectives.bandwidth import bus_factor  # nccl-tests' busbw = algbw * factor
from distlab.units import human_bytes

COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "barrier")
# torch 2.13 renamed the single-tensor all-gather and reduce-scatter; logs use the old names
# on every version, so that checks written against either read the same.
_RENAMED = {"all_gather_single": "all_gather_into_tensor",
            "reduce_scatter_single": "reduce_scatter_tensor"}
P2P = ("send", "recv", "isend", "irecv")
SENDS = ("send", "isend")

@dataclasses.dataclass
class CommEvent:
    """One call, as seen by the rank that made it."""

    op: str
    nbytes: int
    dtype: str | None
    rank: int
    peer: int | None          # the other rank of a P2P call, or the root of broadcast/reduce
    group_size: int
    group_ranks: tuple[int, ...]
    async_op: bool
    start: float              # time.perf_counter() on this rank
    end: float | None = None  # None while an async op is still in flight
    batch: int | None = None  # P2P ops of one batch_isend_irecv share an id (unique per
                              # rank); None for a call of its own

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def describe(self) -> str:
        return _describe(self.op, self.nbytes, self.dtype, self.peer)


def _describe(op: str, nbytes: int, dtype: str | None, peer: int | None) -> str:
    """all_reduce(16.0 MiB float32), send(4.0 KiB float32 to 1), ..."""
    peer = "" if peer is None else (
        f" {'to' if op in SENDS else 'from' if op in ('recv', 'irecv') else 'root'} {peer}")
    return f"{op}({human_bytes(nbytes)}{' ' + dtype if dtype else ''}{peer})"


class CommLog:
    """Every traced call this rank makes while the log is active.

    >>> with CommLog() as log:
    ...     dist.all_reduce(t)
    >>> log.count("all_reduce"), log.nbytes("all_reduce")

    A log is picklable, so a launched function can return it to the notebook for
    volume checks and timelines.
    """

    def __init__(self):
        self.events: list[CommEvent] = []
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.origin = time.perf_counter()

    def __enter__(self) -> "CommLog":
        install()
        self.origin = time.perf_counter()
        with _logs_lock:
            _logs.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _logs_lock:
            _logs.remove(self)

    def __getstate__(self):
        return {"events": self.events, "rank": self.rank, "origin": self.origin}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def records(self) -> list[dict]:
        """The events as plain dicts: what a launched function returns where only plain
        data may travel back (the autograder's ranks run untrusted code)."""
        return [dataclasses.asdict(e) for e in self.events]

    @classmethod
    def from_records(cls, records: list[dict], rank: int = 0) -> "CommLog":
        """A log rebuilt from :meth:`records`, for checks made outside the rank. The
        grader counts these (:func:`logs_rebuilt`): a check on one rests on what a rank
        reported about itself."""
        _rebuilt[0] += 1
        log = cls.__new__(cls)
        fields = {f.name for f in dataclasses.fields(CommEvent)}
        log.events = [CommEvent(**{k: v for k, v in r.items() if k in fields}) for r in records]
        for e in log.events:
            e.group_ranks = tuple(e.group_ranks)
        log.rank, log.origin = rank, 0.0
        return log

    def select(self, op: str | tuple[str, ...] | None = None) -> list[CommEvent]:
        ops = (op,) if isinstance(op, str) else op
        return [e for e in self.events if ops is None or e.op in ops]

    def ops(self) -> list[str]:
        return [e.op for e in self.events]

    def count(self, op: str | tuple[str, ...] | None = None) -> int:
        return len(self.select(op))

    def nbytes(self, op: str | tuple[str, ...] | None = None) -> int:
        """Total message bytes of the selected calls."""
        return sum(e.nbytes for e in self.select(op))

    def bytes_sent(self) -> int:
        """Bytes this rank pushed through point-to-point sends."""
        return self.nbytes(SENDS)

    def collectives(self) -> list[CommEvent]:
        return self.select(COLLECTIVES)

    def bus_bytes(self) -> float:
        """Bytes per rank on the wire for a bandwidth-optimal (ring) algorithm: each
        collective's size times its nccl-tests bus factor, plus P2P sends."""
        total = float(self.bytes_sent())
        for e in self.collectives():
            if e.op in ("barrier", "gather", "scatter"):
                continue
            total += e.nbytes * bus_factor(e.op, e.group_size)
        return total

    def summary(self) -> str:
        """A table: op, calls, total bytes."""
        rows: dict[str, list[int]] = {}
        for e in self.events:
            rows.setdefault(e.op, [0, 0])
            rows[e.op][0] += 1
            rows[e.op][1] += e.nbytes
        lines = [f"rank {self.rank}: {len(self.events)} calls"]
        lines += [f"  {op:<24}{n:>6} x  {human_bytes(b):>10}" for op, (n, b) in rows.items()]
        return "\n".join(lines)


_rebuilt = [0]  # CommLogs rebuilt from records in this process


def logs_rebuilt() -> int:
    """How many CommLogs this process rebuilt from a rank's records
    (:meth:`CommLog.from_records`): the autograder marks the points of a test that read
    one as self-reported (see :mod:`distlab.grading.wire`)."""
    return _rebuilt[0]


def in_group(group) -> bool:
    """Whether this rank is a member of ``group`` (None: the default group); torch gives
    a rank outside a group the rank -1 in it."""
    return group is None or dist.get_rank(group) >= 0


def check_group(group, what: str) -> None:
    """Say what is wrong before a collective fails: no process group, or this rank not
    in ``group``."""
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs a process group: call it inside a function run by "
                           f"distlab.launch.run (or under torchrun)")
    if not in_group(group):
        raise ValueError(f"this rank is not a member of group: build the {what} only on the "
                         f"ranks of the group")


class _State(threading.local):
    def __init__(self):
        self.depth = 0
        self.batch: int | None = None  # id of the batch_isend_irecv under way


# Active logs are seen by every thread of the process: on CUDA, autograd runs backward
# hooks (which launch DDP-style bucket all-reduces) in a thread of its own.
_logs: list["CommLog"] = []
_logs_lock = threading.Lock()


_batch_ids = itertools.count(1)


_state = _State()
_status: "StatusBoard | None" = None
_installed = False


class StatusBoard:
    """A few bytes of shared memory where a rank posts the call it is in, so that the
    launcher can say where each rank stood when a launch hangs.

    Layout: a count of finished posts, the text, a count of started posts. The writer
    bumps the last, writes the text, then the first; a reader that sees two equal counts
    around the text read a whole post, never half of one (a seqlock)."""

    SIZE = 256
    _TEXT = slice(4, SIZE - 4)

    def __init__(self, buffer):
        self.buffer = buffer
        self.count = 0

    def post(self, text: str) -> None:
        self.count = (self.count + 1) % 2**32
        stamp = self.count.to_bytes(4, "little")
        data = text.encode()[: self._TEXT.stop - self._TEXT.start - 1] + b"\0"
        self.buffer[self.SIZE - 4:] = stamp
        self.buffer[self._TEXT.start:self._TEXT.start + len(data)] = data
        self.buffer[:4] = stamp

    @classmethod
    def read(cls, buffer, attempts: int = 100) -> str:
        """The last whole post in ``buffer`` (an mmap of the board), or "" if none."""
        for _ in range(attempts):
            finished = bytes(buffer[:4])
            text = bytes(buffer[cls._TEXT])
            if bytes(buffer[cls.SIZE - 4:cls.SIZE]) == finished:
                return text.split(b"\0", 1)[0].decode(errors="replace")
        return ""


def post_status_to(board: StatusBoard | None) -> None:
    global _status
    _status = board


def _bytes_of(op: str, a: dict) -> tuple[int, str | None]:
    def one(t):
        return t.numel() * t.element_size(), str(t.dtype).removeprefix("torch.")

    def many(ts):
        return sum(one(t)[0] for t in ts), (one(ts[0])[1] if ts else None)

    if op == "all_gather_into_tensor":
        return one(a["output_tensor"])
    if op == "all_gather":
        return many(a["tensor_list"])
    if op == "reduce_scatter_tensor":
        return one(a["input"])
    if op == "reduce_scatter":
        return many(a["input_list"])
    if op == "all_to_all_single":
        return one(a["input"])
    if op == "all_to_all":
        return many(a["input_tensor_list"])
    if op == "barrier":
        return 0, None
    return one(a["tensor"])


def _peer(op: str, a: dict, group) -> int | None:
    for key in ("dst", "src"):
        if a.get(key) is not None:
            return a[key]
    for key in ("group_dst", "group_src"):
        if a.get(key) is not None:
            return dist.get_global_rank(group or c10d._get_default_group(), a[key])
    return None


def _trace(name: str, fn):
    names = tuple(inspect.signature(fn).parameters)  # bound by hand: inspect's bind is slow

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if _state.depth or not (_logs or _status):
            return fn(*args, **kwargs)
        a = dict(zip(names, args), **kwargs)
        group = a.get("group")
        try:
            nbytes, dtype = _bytes_of(name, a)
        except (KeyError, AttributeError):  # a call torch itself will refuse, with its words
            return fn(*args, **kwargs)
        if not _logs and name not in P2P:  # the status board alone: cheap, as hooks call it
            return _posted(_describe(name, nbytes, dtype, _peer(name, a, group)),
                           bool(a.get("async_op")), fn, args, kwargs)
        event = CommEvent(
            op=name, nbytes=nbytes, dtype=dtype, rank=dist.get_rank(),
            peer=_peer(name, a, group), group_size=dist.get_world_size(group),
            group_ranks=tuple(dist.get_process_group_ranks(group or c10d._get_default_group())),
            async_op=bool(a.get("async_op")) or name in ("isend", "irecv"),
            start=time.perf_counter(), batch=_state.batch if name in P2P else None)
        if _status:
            _status.post(f"in {event.describe()} since {time.time():.3f}")
        result = _inner(fn, args, kwargs)
        if name == "recv" and event.peer is None and isinstance(result, int):
            event.peer = result
        if event.async_op and result is not None:
            result = _finish_later(event, result)
        else:
            event.end = time.perf_counter()
        if _status:
            issued = " issued async" if event.async_op else ""
            _status.post(f"after {event.describe()}{issued} at {time.time():.3f}")
        with _logs_lock:
            for log in _logs:
                log.events.append(event)
        return result

    traced.__distlab_traced__ = fn
    return traced


def _posted(text: str, async_op: bool, fn, args, kwargs):
    """Run a collective with only the status board to keep: where this rank is, and
    nothing that a log would need (its group's ranks, its end through a callback)."""
    _status.post(f"in {text} since {time.time():.3f}")
    result = _inner(fn, args, kwargs)
    _status.post(f"after {text}{' issued async' if async_op else ''} at {time.time():.3f}")
    return result


def _inner(fn, args, kwargs):
    """``fn(*args, **kwargs)`` with the calls it makes itself left untraced."""
    _state.depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        _state.depth -= 1


def _trace_batch(fn):
    """``batch_isend_irecv`` issues each of its ops through ``P2POp.op`` (the traced
    ``isend``/``irecv``), on every backend and torch version; the ops it issues carry
    one batch id, so that a log tells a batch (one NCCL group) from single calls."""

    @functools.wraps(fn)
    def traced(p2p_op_list):
        if _state.batch is not None:
            return fn(p2p_op_list)
        _state.batch = next(_batch_ids)
        try:
            return fn(p2p_op_list)
        finally:
            _state.batch = None

    traced.__distlab_traced__ = fn
    return traced


def _finish_later(event: CommEvent, work):
    """Stamp the end of an async op when it completes: through its future where the
    backend has one, else when the caller's ``wait()`` returns (gloo's send/recv)."""
    try:
        work.get_future().add_done_callback(
            lambda _: setattr(event, "end", time.perf_counter()))
        return work
    except (RuntimeError, AttributeError):
        return _TracedWork(work, event)


class _TracedWork:
    """A Work handle that records when ``wait()`` returned, and posts the wait on the
    status board (a rank stuck there is waiting for a peer, not computing)."""

    def __init__(self, work, event: CommEvent):
        self._work, self._event = work, event

    def wait(self, *args, **kwargs):
        if _status:
            _status.post(f"in wait for {self._event.describe()} since {time.time():.3f}")
        result = self._work.wait(*args, **kwargs)
        if self._event.end is None:
            self._event.end = time.perf_counter()
        if _status:
            _status.post(f"after wait for {self._event.describe()} at {time.time():.3f}")
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def install() -> None:
    """Route the primitives of torch.distributed through the tracer (idempotent)."""
    global _installed
    if _installed:
        return
    for name in COLLECTIVES + P2P + tuple(_RENAMED):
        original = getattr(c10d, name, None)
        if original is None:  # a name this version of torch does not have
            continue
        traced = _trace(_RENAMED.get(name, name), getattr(original, "__distlab_traced__", original))
        setattr(c10d, name, traced)
        setattr(dist, name, traced)
    batched = _trace_batch(getattr(c10d.batch_isend_irecv, "__distlab_traced__",
                                   c10d.batch_isend_irecv))
    c10d.batch_isend_irecv = dist.batch_isend_irecv = batched
    _installed = True


def untraced(fn):
    """``fn`` without the tracer: what a benchmark times (the backend, not the
    bookkeeping of every call, which costs tens of microseconds)."""
    return getattr(fn, "__distlab_traced__", fn)


@contextlib.contextmanager
def quiet():
    """Calls made inside, on this thread, run untraced: no log records them and the
    status board is left alone. A benchmark times every contender inside it, so that
    code built from many traced calls (a ring in Python) pays no more bookkeeping per
    call than the backend's one call wrapped in :func:`untraced`."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def single_tensor_op(kind: str):
    """torch's one-tensor ``"all_gather"`` or ``"reduce_scatter"``, by the name this
    version prefers (``*_single`` from torch 2.13, ``*_tensor`` before)."""
    new, old = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}[kind]
    return getattr(dist, new, None) or getattr(dist, old)


def all_gather_into(output, input, group=None, async_op=False):
    """All-gather into one tensor (:func:`single_tensor_op`)."""
    return single_tensor_op("all_gather")(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce-scatter from one tensor (:func:`single_tensor_op`)."""
    return single_tensor_op("reduce_scatter")(output, input, op=op, group=group,
                                              async_op=async_op)
