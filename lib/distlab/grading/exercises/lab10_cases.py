"""What lab 10's two exercise tests share: one launch per world size whose outcome (or
error) is kept for every test that reads it, with the bytes it put on the wire; and
bad inputs that must raise ValueError before any communication."""
import pytest

from distlab import launch
from distlab.grading import wire

TIMEOUT = 90


class Outcomes:
    """``Outcomes(run_cases)[student, name, world]``: every rank's findings of
    ``run_cases(student's name)`` on ``world`` gloo ranks, launched once; ``reading``
    holds what each launch put on the wire."""

    def __init__(self, run_cases):
        self.run_cases, self.runs, self.reading = run_cases, {}, {}

    def __call__(self, student, name, world):
        if world not in self.runs:
            with wire.measure(world) as self.reading[world]:
                try:
                    self.runs[world] = launch.run(self.run_cases, world, getattr(student, name),
                                                  backend="gloo", timeout=TIMEOUT)
                except launch.LaunchError as exc:
                    self.runs[world] = exc
        if isinstance(self.runs[world], Exception):
            raise self.runs[world]
        return self.runs[world]


def check_errors(student, name, run_errors, what_bad):
    """``run_errors(fn)`` on 2 ranks returns {what: (exception name or "returned",
    communication calls made)}; each must be ValueError after no call."""
    try:
        found = launch.run(run_errors, 2, getattr(student, name), backend="gloo", timeout=30)
    except launch.LaunchTimeout:
        pytest.fail(f"bad inputs ({what_bad}) hung the ranks: raise ValueError before any "
                    f"communication")
    for rank, per in enumerate(found):
        for what, (kind, calls) in per.items():
            assert kind == "ValueError" and calls == 0, (
                f"rank {rank}, {what}: {name} "
                f"{'returned' if kind == 'returned' else 'raised ' + kind} after {calls} "
                f"communication call(s); raise ValueError before any")
