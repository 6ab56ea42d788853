"""Replicas that agree on a quorum at every step, on a store they share: torchft's
Lighthouse and Manager, in a few lines.

Each data-parallel replica is a job of its own (one ``launch.run`` each), so a replica
that dies takes no other down. They meet on a ``TCPStore`` (:func:`lighthouse`), where
each :class:`Manager` posts a heartbeat every ``HEARTBEAT_S`` from a thread of its own,
and at every step :meth:`Manager.quorum` forms the set of replicas alive now: the first
to arrive waits until every replica whose heartbeat is fresh (younger than ``STALE_S``)
has registered, or ``join_s`` at most, then closes the round. The members get a gloo
process group of their own (a new one whenever the membership changes), reached through
:class:`Quorum`'s collectives, which raise :class:`ReplicaLost` when a member dies in
the middle, and :meth:`Quorum.agree`, the vote on which a step commits.

Faults are real: a :class:`Manager` given ``kill_in_step=k`` dies by SIGKILL in the
middle of the first all-reduce of step ``k``: the other members enter it, and it never
completes (:func:`die_by_sigkill`; a process that issued it and then spun until the
kernel's SIGKILL would let gloo's thread finish it meanwhile).
"""
from __future__ import annotations

import datetime
import resource
import threading
import time

import torch
import torch.distributed as dist

POLL_S = 0.005
HEARTBEAT_S, STALE_S = 0.05, 1.0


def die_by_sigkill() -> None:
    """End this process with a SIGKILL from the kernel: a CPU-time limit a second away,
    then spin. (A process cannot SIGKILL itself where it is the init of its own PID
    namespace, as a graded rank is: the kernel ignores a signal it sends itself there,
    but not the one the CPU limit raises.)"""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limit = int(usage.ru_utime + usage.ru_stime) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit))
    while True:
        pass


class ReplicaLost(RuntimeError):
    """A member of the quorum died (or stopped answering) during a collective."""


def lighthouse(port: int = 0) -> dist.TCPStore:
    """The store the replicas meet on, served by the calling process (``.port``)."""
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def connect(port: int) -> dist.TCPStore:
    """A replica's client of the :func:`lighthouse` on ``port``."""
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))


class Quorum:
    """The replicas alive at one step: ``members`` (replica ids, increasing), ``steps``
    (each member's step when it joined), ``me`` (this replica's id)."""

    def __init__(self, manager: "Manager", number: int, members: list[int],
                 steps: dict[int, int], pg):
        self.manager, self.number, self.members, self.steps = manager, number, members, steps
        self.me = manager.replica_id
        self._pg = pg
        self._step = max(steps.values())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the element-wise sum of ``tensor`` over the members."""
        if self.manager.kill_in_step == self._step:   # the others are in it: dead
            die_by_sigkill()
        return self._wait(self._pg.allreduce([tensor]), tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In place: member ``src``'s ``tensor`` on every member."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.members.index(src)
        return self._wait(self._pg.broadcast([tensor], opts), tensor)

    def _wait(self, work, tensor):
        try:
            work.wait()
        except Exception as exc:  # gloo: "Connection closed by peer", or its timeout
            self.manager._last = None   # a group that failed is never used again
            raise ReplicaLost(f"a member of quorum {self.number} ({self.members}) was lost: "
                              f"{str(exc).splitlines()[0][:200]}") from None
        return tensor

    def agree(self, ok: bool) -> bool:
        """True iff every member says ``ok`` within the manager's timeout (a member that
        died never does); the same answer on every member that returns."""
        store, key = self.manager.store, f"q{self.number}/vote"
        if not ok:
            store.set(f"{key}/no", "1")
        voted = store.add(f"{key}/n", 1)
        deadline = time.monotonic() + self.manager.timeout_s
        while voted < len(self.members):
            if store.check([f"{key}/no"]) or time.monotonic() > deadline:
                store.set(f"{key}/no", "1")
                return False
            time.sleep(POLL_S)
            voted = store.add(f"{key}/n", 0)
        return not store.check([f"{key}/no"])


class Manager:
    """One replica's side of the quorum. ``replicas``: the replica ids of the run are
    0 to ``replicas - 1`` (a replacement takes a dead one's id), ``join_s``: the longest
    a round waits for a live replica to register, ``timeout_s``: how long a collective or
    a vote waits for a member."""

    def __init__(self, store, replica_id: int, replicas: int, *, join_s: float = 3.0,
                 timeout_s: float = 5.0, kill_in_step: int | None = None):
        self.store, self.replica_id, self.replicas = store, replica_id, replicas
        self.join_s, self.timeout_s, self.kill_in_step = join_s, timeout_s, kill_in_step
        beat = dist.TCPStore(store.host, store.port, is_master=False,
                             timeout=datetime.timedelta(seconds=30))
        self._beat(beat)
        threading.Thread(target=self._beating, args=(beat,), daemon=True).start()
        self._last: tuple[int, tuple[int, ...], object] | None = None  # (round, members, pg)
        self.last_quorum: Quorum | None = None

    def quorum(self, step: int) -> Quorum:
        """Join the next round at ``step`` (this replica's step) and return its quorum."""
        store = self.store
        while True:
            number = store.add("round", 0)
            seat = store.add(f"q{number}/n", 1)
            last = self._last[0] if self._last else -1
            store.set(f"q{number}/seat{seat}", f"{self.replica_id} {step} {last}")
            if seat == 1:
                self._close(number)
            store.wait([f"q{number}/closed"], datetime.timedelta(seconds=self.timeout_s + self.join_s))
            size = int(store.get(f"q{number}/closed"))
            if seat <= size:
                break
        seats = [store.get(f"q{number}/seat{s}").decode().split() for s in range(1, size + 1)]
        steps = {int(r): int(s) for r, s, _ in seats}
        members = sorted(steps)
        lasts = {int(prev) for _, _, prev in seats}
        if self._last and lasts == {self._last[0]} and tuple(members) == self._last[1]:
            pg = self._last[2]   # the same members as last round: keep its group
        else:
            prefix = dist.PrefixStore(f"q{number}/pg", store)
            pg = dist.ProcessGroupGloo(prefix, members.index(self.replica_id), len(members),
                                       datetime.timedelta(seconds=self.timeout_s))
        self._last = (number, tuple(members), pg)
        self.last_quorum = Quorum(self, number, members, steps, pg)
        return self.last_quorum

    def _beat(self, store) -> None:
        store.set(f"alive/{self.replica_id}", repr(time.time()))

    def _beating(self, store) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            self._beat(store)

    def alive(self) -> int:
        """How many replicas posted a heartbeat within ``STALE_S``."""
        keys = [f"alive/{r}" for r in range(self.replicas)]
        now = time.time()
        return sum(now - float(self.store.get(k)) < STALE_S for k in keys if self.store.check([k]))

    def _close(self, number: int) -> None:
        """The round's first arrival: wait until every live replica registered (``join_s``
        at most), then close."""
        deadline = time.monotonic() + self.join_s
        while self.store.add(f"q{number}/n", 0) < self.alive() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.store.add("round", 1)            # later arrivals go to the next round
        self.store.set(f"q{number}/closed", str(self.store.add(f"q{number}/n", 0)))
