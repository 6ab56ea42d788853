"""What each pipeline stage did and when: the recorder of a stage's timeline.

A :class:`StageEvents` records one stage's step as events, plain dicts that travel back
from a launched rank as they are:

    {"stage": 1, "kind": "F", "mb": 3, "start": 12.034, "end": 12.051, "live": 2}

``kind`` is "F" or "B" (the forward or backward of micro-batch ``mb``; ``live`` is the
number of micro-batches whose activations the stage holds after it), or "comm" (one
group of transfers, ``what`` lists them, e.g. "send act 3 to 2, recv grad 1 from 2").
Times are seconds of ``time.perf_counter()``, one clock for every process of a machine
(Linux's CLOCK_MONOTONIC), so the stages' timelines line up. On a GPU the host only
queues the work: there the times come from CUDA events, read after the step.
:func:`distlab.pp.schedule.simulate` makes events of the same shape on an ideal clock;
:mod:`distlab.pp.bubble` measures the bubble and the activations held from either.
"""
from __future__ import annotations

import contextlib
import time

import torch


class StageEvents:
    """Records the actions and transfers of stage ``stage`` on ``device``."""

    def __init__(self, stage: int, device: torch.device | None = None):
        self.stage = stage
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.events: list[dict] = []
        self._marks: list[tuple[dict, object, object]] = []  # CUDA: event, start, end
        if self.cuda:
            torch.cuda.synchronize(device)
            self._origin = (time.perf_counter(), _cuda_event())

    @contextlib.contextmanager
    def record(self, kind: str, mb: int | None = None, **fields):
        """Time the block as one event; ``fields`` are stored with it."""
        event = {"stage": self.stage, "kind": kind, "mb": mb, **fields}
        if self.cuda:
            start = _cuda_event()
            yield event
            self._marks.append((event, start, _cuda_event()))
        else:
            event["start"] = time.perf_counter()
            yield event
            event["end"] = time.perf_counter()
        self.events.append(event)

    def finish(self) -> list[dict]:
        """The events, with the CUDA ones converted to host seconds (waits for the GPU)."""
        if self._marks:
            torch.cuda.synchronize()
            host, origin = self._origin
            for event, start, end in self._marks:
                event["start"] = host + origin.elapsed_time(start) / 1e3
                event["end"] = host + origin.elapsed_time(end) / 1e3
            self._marks = []
        return self.events


def _cuda_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
