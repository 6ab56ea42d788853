"""The timeline of a training step as data: spans of computation and communication on
each rank, instants (a gradient ready), and how much of the communication ran under
computation. :mod:`distlab.bench.trace` records them, :mod:`distlab.viz.timeline` draws
them; both import this module, neither imports the other.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
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
