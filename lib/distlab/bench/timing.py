"""Timing on every rank: the device made idle, a run of calls timed back to back as
nccl-tests does (between CUDA events on a GPU), the host's own time to issue a call,
and the slowest rank's figure agreed by all ranks in one collective."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from distlab import backend


def sync(device: torch.device) -> None:
    """Wait until ``device`` is idle (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call(fn, calls: int, device: torch.device | None = None) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls back to back, the device idle at
    both ends (this rank's own time: no barrier, no agreement between ranks)."""
    device = device or backend.device()
    sync(device)
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - begin) / calls


def host_seconds(call, repeats: int = 5, group=None) -> float:
    """The host's time to issue one ``call()`` (median of ``repeats``, the slowest rank's
    of ``group``), each started on an idle device after a barrier. On a GPU the call
    only queues work: where this nears the call's time, the call is bound by the host
    (Python, kernel launches) and faster GPU work would not shorten it. On gloo the
    calls block, so it is the whole call."""
    device = backend.device()
    distributed = dist.is_available() and dist.is_initialized()
    times = []
    for _ in range(repeats):
        sync(device)
        if distributed:
            dist.barrier(group=group)
            sync(device)
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    sync(device)
    return _slowest([statistics.median(times)], group)[0]


def _slowest(values: list[float], group) -> list[float]:
    """Each of ``values``, the largest over the ranks of ``group`` (itself outside any
    group), in one collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=backend.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def time_op(fn, warmup: int = 5, iters: int = 20, group=None, graph: bool = False) -> float:
    """Seconds per call of ``fn``, timed the way nccl-tests times a collective.

    Call it on every rank of ``group`` (or outside any process group). ``warmup`` calls,
    one barrier, then ``iters`` calls back to back, with no barrier and no wait between
    them: on a GPU between two CUDA events on the current stream (the host only queues
    the calls, so the GPU's time per op is measured, unless issuing a call takes the
    host longer than the GPU takes to run it), on the CPU with ``time.perf_counter``.
    The time per call is the run's time over ``iters``, the slowest rank's; every rank
    returns the same number. ``graph=True`` (CUDA only) captures the ``iters`` calls in
    a CUDA graph and times one replay: no host cost per call at all.
    """
    return time_runs(fn, warmup, iters, group, graph)[0]


def time_runs(fn, warmup: int = 5, iters: int = 20, group=None, graph: bool = False,
              repeats: int = 1) -> list[float]:
    """Seconds per call in each of ``repeats`` runs of :func:`time_op` (each its own
    warm-up, barrier and run back to back; with ``graph``, one capture whose replay
    is warmed up and timed in each run), every rank returning the same list."""
    if warmup < 0 or iters < 1 or repeats < 1:
        raise ValueError(f"need warmup >= 0, iters >= 1 and repeats >= 1, got {warmup}, "
                         f"{iters} and {repeats}")
    device = backend.device()
    if graph and device.type != "cuda":
        raise ValueError("graph=True captures a CUDA graph: it needs a GPU")
    run, iters_in_run = fn, iters
    if graph:
        for _ in range(warmup):
            fn()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(iters):
                fn()
        run, iters_in_run, warmup = captured.replay, 1, 1
    seconds = []
    for _ in range(repeats):
        for _ in range(warmup):
            run()
        sync(device)
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)
            sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters_in_run):
                run()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            begin = time.perf_counter()
            for _ in range(iters_in_run):
                run()
            seconds.append((time.perf_counter() - begin) / iters)
    return _slowest(seconds, group)


def time_each(fn, iters: int = 10, group=None) -> float:
    """Seconds of one call that the program waits for: the median over ``iters`` calls,
    each started right after a barrier and ended when the device is idle again, the
    slowest rank's. Against :func:`time_op` it shows what issuing a call and waiting
    for it cost (launch and synchronisation), on top of the op itself."""
    distributed = dist.is_available() and dist.is_initialized()
    device = backend.device()
    times = []
    for _ in range(iters):
        if distributed:
            dist.barrier(group=group)
        sync(device)
        begin = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - begin)
    if distributed:  # one collective for all the calls: the slowest rank's time of each
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    return statistics.median(times)
