"""The bubble of a pipeline, measured from a timeline: what its stages computed, over
how long, and how many micro-batches' activations each held.

A timeline is a list of events, plain dicts (see :mod:`distlab.pp.events`, which
records them, and :func:`distlab.pp.schedule.simulate`, which plays them on an ideal
clock): ``{"stage", "kind", "mb", "start", "end"}``, ``kind`` "F" or "B" for a forward
or backward (with ``"live"``, the micro-batches held after it) or "comm" for a
transfer. The plots of :mod:`distlab.viz.pipeline` read them from here, without
importing the code that made them.
"""
from __future__ import annotations


def compute_events(events: list[dict]) -> list[dict]:
    """The forwards and backwards among ``events``."""
    return [e for e in events if e["kind"] in ("F", "B")]


def idle_fraction(events: list[dict], num_stages: int | None = None) -> float:
    """The measured bubble: 1 - (time the stages computed) / (stages x the step's span).

    The span runs from the first forward's start to the last backward's end over all
    stages; transfers and waits count as idle, as in the formula (p-1)/(m+p-1)."""
    work = compute_events(events)
    if not work:
        raise ValueError("no forward or backward among the events")
    p = num_stages or len({e["stage"] for e in work})
    span = max(e["end"] for e in work) - min(e["start"] for e in work)
    busy = sum(e["end"] - e["start"] for e in work)
    return 1.0 - busy / (p * span)


def peak_live(events: list[dict]) -> dict[int, int]:
    """Stage -> the most micro-batches whose activations it held at once."""
    peaks: dict[int, int] = {}
    for e in events:
        if "live" in e:
            peaks[e["stage"]] = max(peaks.get(e["stage"], 0), e["live"])
    return peaks
