"""One cgroup per graded rank, and one per grading run around them: the memory and the
number of processes of a whole tree counted together, where the per-process limits
(RLIMIT_DATA, RLIMIT_AS) let each of a rank's children take the whole cap again.

A grading run's cgroup (:func:`run_limits`) is made by the grader before it starts the
run, joined by the run's supervisor (:mod:`distlab.grading.sandbox`) before it starts
anything, and removed when the run has ended: the run's pytest, its fork server and
every rank count in it. A rank's cgroup is made by the fork server before it forks the
rank, below the run's, joined by the rank before it runs anything else, and removed
when the server reaps it (empty by then: the rank is PID 1 of its namespace, and every
process it started died with it). Each caps ``memory.limit_in_bytes`` and ``pids.max``
in the cgroup v1 hierarchies ``memory`` and ``pids``, below the maker's own cgroup of
each. Where those are not mounted or not
writable (a grader that is not root, a host with cgroup v2 alone, whose controllers a
process can only use from a leaf it was delegated) :func:`make` returns None: the
per-rank limits of :mod:`distlab.runtime.confine` and :mod:`distlab.grading.student`
still hold, and a rank's tree is capped per process only.
"""
from __future__ import annotations

import os
import time

V1 = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "pids")
# what a rank's tree holds beyond the memory cap of its allocations (--memory): its three
# tmpfs (64 MiB each by default), the page cache of what it reads, gloo's buffers
SLACK_MB = 512
# a grading run: at most this many ranks alive at once (the graded launches start up to 4;
# a launch's warm ranks may outlive it beside the next launch's), and what its pytest and
# fork server hold besides (torch imported, their threads)
RUN_RANKS, RUN_MB, RUN_TASKS = 8, 2048, 512
PREFIX = "distlab-"


def _own(controller: str) -> str | None:
    """This process's cgroup in ``controller``'s v1 hierarchy (``/proc/self/cgroup``)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(","):
                return path
    return None


class Tree:
    """A process tree's two cgroups (memory, pids): made with their limits, joined, removed."""

    def __init__(self, folders: list[str]):
        self.folders = folders

    def join(self) -> None:
        """Move this process (and so everything it starts) into the cgroups."""
        for folder in self.folders:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def remove(self) -> None:
        for folder in self.folders:
            try:
                os.rmdir(folder)
            except OSError:  # not empty yet, or gone: the host's cgroup release takes it
                pass


def make(name: str, memory_bytes: int, processes: int) -> Tree | None:
    """The cgroups ``name`` below this process's own, capped at ``memory_bytes`` (the
    tree's memory, page cache and tmpfs included) and ``processes`` tasks; None where
    they cannot be made here."""
    made: list[str] = []
    _sweep()
    try:
        for controller, (knob, value) in zip(CONTROLLERS, (("memory.limit_in_bytes", memory_bytes),
                                                            ("pids.max", processes))):
            own = _own(controller)
            if own is None:
                raise OSError(f"no cgroup v1 {controller} hierarchy")
            folder = os.path.join(V1, controller, own.lstrip("/"), name)
            os.mkdir(folder, 0o755)
            made.append(folder)
            with open(os.path.join(folder, knob), "w") as f:
                f.write(str(int(value)))
    except OSError:
        Tree(made).remove()
        return None
    return Tree(made)


def run_limits(rank_memory_mb: int, rank_processes: int) -> tuple[int, int]:
    """The memory (bytes) and tasks of a grading run's cgroup, whose ranks are capped at
    ``rank_memory_mb`` and ``rank_processes`` each."""
    return ((RUN_RANKS * (rank_memory_mb + SLACK_MB) + RUN_MB) << 20,
            RUN_RANKS * rank_processes + RUN_TASKS)


STALE_S = 3600  # an empty cgroup of ours this old was left by a run that was killed


def _sweep() -> None:
    """Remove the empty cgroups that killed runs left (a run removes its own)."""
    for controller in CONTROLLERS:
        own = _own(controller)
        folder = os.path.join(V1, controller, (own or "").lstrip("/"))
        try:
            names = [n for n in os.listdir(folder) if n.startswith(PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                if time.time() - os.stat(path).st_mtime > STALE_S:
                    os.rmdir(path)  # refused while a process is in it
            except OSError:
                pass


def make_possible() -> bool:
    """Whether :func:`make` can make a rank's cgroups here (a probe made and removed)."""
    probe = make(f"distlab-probe-{os.getpid()}", 1 << 30, 64)
    if probe is None:
        return False
    probe.remove()
    return True
