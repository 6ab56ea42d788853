"""Timelines of a training step: when each rank computed, when each collective ran,
and how much of the communication was hidden under computation.

Two sources, one :class:`distlab.timeline.Timeline` (the data, which :mod:`distlab.viz`
draws without importing this module):

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

from distlab.timeline import COMM, COMPUTE, Span, Timeline

__all__ = ["Span", "StepRecorder", "Timeline", "kernel_timeline", "load_chrome_trace", "profile"]


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
