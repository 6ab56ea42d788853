"""Timelines of a training step: when each rank computed, when each collective ran,
and how much of the communication was hidden under computation.

Two sources, one :class:`Timeline`:

- on CPUs (and for the order of events anywhere), :class:`StepRecorder` times the
  phases of a step on the host (forward, backward, the wait for the last all-reduce,
  the optimizer step), marks the moment each gradient is accumulated (a
  post-accumulate-grad hook), and takes each collective's start and end from a
  :class:`distlab.comm.CommLog`;
- on GPUs, where the host only queues work, :func:`profile` records a few steps with
  ``torch.profiler`` and :func:`kernel_timeline` reads the kernels back from its
  Chrome trace: NCCL kernels are communication, every other kernel computation.

:meth:`Timeline.hidden_fraction` is the share of communication time during which the
rank was also computing: 1 when every collective ran under compute, 0 when the
compute waited for each of them. :meth:`Timeline.to_chrome_trace` writes the timeline
in the Trace Event format, which https://ui.perfetto.dev and ``chrome://tracing`` open,
as they open torch.profiler's own traces.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

COMPUTE, COMM = "compute", "comm"


@dataclasses.dataclass
class Span:
    """One stretch of work on one rank: ``lane`` is "compute" or "comm"; times in
    seconds on a clock all ranks of a host share (``time.perf_counter``)."""

    rank: int
    lane: str
    name: str
    start: float
    end: float
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


def union(intervals) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(interval, disjoint) -> float:
    """Seconds of ``interval`` that the sorted, disjoint intervals ``disjoint`` cover."""
    s, e = interval
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in disjoint)


def hidden_fraction(comm, compute) -> float:
    """Share of the communication time (the union of ``comm`` intervals) during which
    some ``compute`` interval ran; NaN when there was no communication."""
    comm_union = union(comm)
    total = sum(e - s for s, e in comm_union)
    if total <= 0:
        return float("nan")
    busy = union(compute)
    return sum(covered(c, busy) for c in comm_union) / total


@dataclasses.dataclass
class Timeline:
    """Spans of every rank, and instants (``marks``: rank, name, time), e.g. the moment
    each gradient was ready."""

    spans: list[Span] = dataclasses.field(default_factory=list)
    marks: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans} | {m[0] for m in self.marks})

    def select(self, lane: str | None = None, rank: int | None = None) -> list[Span]:
        return [s for s in self.spans
                if (lane is None or s.lane == lane) and (rank is None or s.rank == rank)]

    def hidden_fraction(self, rank: int | None = None) -> float:
        """Share of communication hidden under computation: of one rank, or the mean
        over the ranks."""
        ranks = self.ranks if rank is None else [rank]
        fractions = [hidden_fraction([(s.start, s.end) for s in self.select(COMM, r)],
                                     [(s.start, s.end) for s in self.select(COMPUTE, r)])
                     for r in ranks]
        fractions = [f for f in fractions if f == f]
        return sum(fractions) / len(fractions) if fractions else float("nan")

    def comm_seconds(self, rank: int | None = None) -> float:
        """Seconds during which a collective was in flight (the union of comm spans)."""
        ranks = self.ranks if rank is None else [rank]
        per_rank = [sum(e - s for s, e in union((x.start, x.end) for x in self.select(COMM, r)))
                    for r in ranks]
        return sum(per_rank) / len(per_rank) if per_rank else 0.0

    @property
    def origin(self) -> float:
        times = [s.start for s in self.spans] + [m[2] for m in self.marks]
        return min(times) if times else 0.0

    @property
    def duration(self) -> float:
        times = [s.end for s in self.spans] + [m[2] for m in self.marks]
        return max(times) - self.origin if times else 0.0

    def records(self) -> dict:
        """Plain data (what a launched function may return)."""
        return {"spans": [dataclasses.asdict(s) for s in self.spans],
                "marks": [list(m) for m in self.marks]}

    @classmethod
    def from_records(cls, records) -> "Timeline":
        """The timeline of :meth:`records`, or of a list of them (one per rank) merged."""
        if isinstance(records, dict):
            records = [records]
        spans, marks = [], []
        for r in records:
            spans += [Span(**s) for s in r["spans"]]
            marks += [tuple(m) for m in r["marks"]]
        return cls(spans, marks)

    def to_chrome_trace(self, path) -> Path:
        """Write the Trace Event format (JSON; ``.json.gz`` compressed) that Perfetto
        and ``chrome://tracing`` open: one process per rank, one thread per lane."""
        t0, events = self.origin, []
        lanes = {COMPUTE: 0, COMM: 1}
        for r in self.ranks:
            events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                           "args": {"name": f"rank {r}"}})
            for lane, tid in lanes.items():
                events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                               "args": {"name": lane}})
        for s in self.spans:
            events.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": s.rank,
                           "tid": lanes.get(s.lane, 2), "ts": 1e6 * (s.start - t0),
                           "dur": 1e6 * s.seconds, "args": {"bytes": s.nbytes}})
        for rank, name, t in self.marks:
            events.append({"ph": "i", "s": "t", "name": name, "pid": rank, "tid": 0,
                           "ts": 1e6 * (t - t0)})
        path = Path(path)
        text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
        if path.suffix == ".gz":
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


class StepRecorder:
    """Host-side timing of training steps in a rank.

    >>> rec = StepRecorder(model.module)          # marks each gradient as it is ready
    >>> with CommLog() as log:
    ...     with rec.span("forward"): loss = loss_fn(model(x), y)
    ...     with rec.span("backward"): loss.backward()
    ...     with rec.span("wait"): model.finish_gradient_synchronization()
    ...     with rec.span("step"): opt.step()
    >>> rec.timeline(log).records()               # plain data for the notebook

    Spans named "wait" (:data:`WAITING`) are the host blocked on communication, not
    computing: they go in a lane of their own, which plots draw on the compute row and
    :meth:`Timeline.hidden_fraction` does not count as compute. Build the recorder
    before the wrapper, so that its marks precede the wrapper's launches.
    """

    def __init__(self, module=None, rank: int | None = None):
        import torch.distributed as dist

        self.rank = rank if rank is not None else (
            dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
        self.spans: list[Span] = []
        self.marks: list[tuple[int, str, float]] = []
        self._hooks = []
        if module is not None:
            for name, p in module.named_parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda _, name=name: self.marks.append(
                            (self.rank, name, time.perf_counter()))))

    @contextlib.contextmanager
    def span(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            lane = "wait" if name in WAITING else COMPUTE
            self.spans.append(Span(self.rank, lane, name, start, time.perf_counter()))

    def timeline(self, log=None) -> Timeline:
        """The recorded spans and marks, with the collectives of ``log`` (a CommLog or its
        records) as comm spans (a collective still in flight ends at its last record)."""
        from distlab.comm import CommLog

        spans = list(self.spans)
        if log is not None:
            log = log if isinstance(log, CommLog) else CommLog.from_records(log)
            for e in log.collectives():
                end = e.end if e.end is not None else e.start
                spans.append(Span(self.rank, COMM, e.describe(), e.start, end, e.nbytes))
        return Timeline(spans, list(self.marks))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


WAITING = ("wait",)  # span names that mean "blocked on communication", not computing


def profile(step, steps: int = 2, warmup: int = 1, path=None):
    """Run ``step()`` ``warmup`` times, then ``steps`` times under ``torch.profiler``
    (CPU, and CUDA where the ranks have GPUs); export the Chrome trace to ``path`` (a
    ``.json`` or ``.json.gz`` file) when given. Returns the profiler."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    prof = torch_profile(activities=activities)
    with _without_kineto_markers():   # the with statement's enter and exit, quieted
        prof.__enter__()
    try:
        for _ in range(steps):
            step()
        if ProfilerActivity.CUDA in activities:
            torch.cuda.synchronize()
    finally:
        with _without_kineto_markers():
            prof.__exit__(None, None, None)
    if path is not None:
        path = Path(path)
        if path.suffix == ".gz":
            raw = path.with_suffix("")
            prof.export_chrome_trace(str(raw))
            path.write_bytes(gzip.compress(raw.read_bytes()))
            raw.unlink()
        else:
            prof.export_chrome_trace(str(path))
    return prof


@contextlib.contextmanager
def _without_kineto_markers():
    """Drop the lines ``USDT:... profiler_start`` and ``... profiler_stop`` that Kineto
    (the tracer under torch.profiler) writes to file descriptor 2 when a profile starts
    and stops; pass every other line through. ``KINETO_LOG_LEVEL`` could silence them
    only with Kineto's warnings and errors."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not line.startswith(b"USDT:")]
            rest = b"".join(kept)
            while rest:
                rest = rest[os.write(2, rest):]


def load_chrome_trace(path) -> dict:
    """A Chrome trace file (``.json`` or ``.json.gz``) as a dict."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    trace = json.loads(data)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def kernel_timeline(trace, rank: int = 0) -> Timeline:
    """The GPU kernels of a torch.profiler Chrome trace (a dict or a file path) as a
    timeline of ``rank``: kernels whose name contains "nccl" are communication, the
    others computation. Times in seconds from the trace's clock."""
    if not isinstance(trace, dict):
        trace = load_chrome_trace(trace)
    spans = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or str(ev.get("cat", "")).lower() != "kernel":
            continue
        lane = COMM if "nccl" in ev.get("name", "").lower() else COMPUTE
        start = float(ev["ts"]) / 1e6
        spans.append(Span(rank, lane, ev.get("name", ""), start, start + float(ev["dur"]) / 1e6))
    return Timeline(spans)
