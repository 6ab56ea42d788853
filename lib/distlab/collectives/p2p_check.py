"""Would this point-to-point code hang on NCCL? A check from the calls CommLog recorded.

gloo lets any order of sends and receives finish: each call progresses on its own.
NCCL does not, and code that passes on CPU can hang on GPUs. :func:`nccl_deadlock`
replays every rank's log under NCCL's rules, as torch's ProcessGroupNCCL applies them:

* **Groups.** A ``batch_isend_irecv`` is one NCCL group (``ncclGroupStart`` ...
  ``ncclGroupEnd``, one kernel); a single ``send``/``recv``/``isend``/``irecv`` or
  collective is a group of its own. A group ends only when every operation in it has.
* **One stream per process group.** The kit's launcher (and torchrun code that passes
  ``device_id`` to ``init_process_group``) initialises NCCL eagerly; then torch runs
  every P2P call of a process group, batched or single, and its collectives, on that
  group's one communicator and stream (ProcessGroupNCCL::pointToPoint, "eagerInit":
  "unbatched P2P ops are treated as independent collective ops, and are thus
  serialized"). So a rank's groups on one process group run one after the other, in
  the order they were issued. Lazily initialised torch gives single P2P calls a stream
  per pair of ranks instead; one stream per group is the stricter of the two, so code
  that passes here passes there too.
* **Matching.** On one process group, the k-th send from rank a to rank b is received
  by the k-th receive at b from a (NCCL, like MPI, keeps the order per pair). An
  operation can complete only while the groups holding it and its match both run; the
  k-th collective of a process group needs every member's k-th collective running.
  A conservative rule: even a small send waits for its receive (NCCL may buffer small
  messages, but code must not rely on it).
* **The host never waits** on NCCL (``wait()`` only orders streams), so every call is
  issued in the order of the log, except after a ``barrier``, which blocks the host
  until it is done.
* **Connections.** NCCL connects two ranks lazily, in the first group in which they
  exchange: each side sets up the directions its group uses with the other (a send to
  it, a receive from it; as many channels whatever the message size), and the two sides
  swap their setup records over NCCL's bootstrap sockets (``ncclTransportP2pSetup``).
  So each rank's first group with the other must use the same directions: a sends to b
  in its group exactly when b receives from a in its own, and the other way round. (A
  direction first used later is then set up later on both sides alike.) Otherwise the
  setup fails: between two ranks (or two ranks half the group apart) the two records
  differ in size and NCCL stops with "Message truncated : received N bytes instead of
  M"; elsewhere a side waits in the setup for a record the other never sends. The logs
  are taken to begin before the pair's first exchange on that process group, as in a
  fresh program (code whose first groups agree is safe whatever was connected before).

What the log cannot show is not modelled: a host synchronisation of the student's own
(``.item()``, ``.cpu()``, ``torch.cuda.synchronize()``) between two calls.

Besides hangs, it reports matched sends and receives whose sizes differ (NCCL needs the
same count and dtype on both sides), receives without a source (NCCL has no receive
from any source) and first exchanges that would fail NCCL's connection setup.
``nccl_deadlock(logs)`` returns None when none of this happens, else an account in
plain words.
"""
from __future__ import annotations

import collections
import dataclasses

from distlab.comm import COLLECTIVES, SENDS, CommEvent, CommLog
from distlab.units import human_bytes

RECEIVES = ("recv", "irecv")
RULE = ("NCCL runs a rank's calls on one process group in order, on one stream, and a "
        "batch_isend_irecv (an NCCL group) ends only when every operation in it has; so "
        "each send must be matched by a receive that the peer posts in the same batch or an "
        "earlier one (and the other way round). gloo does not enforce this: the code ran on "
        "CPU, and would hang on GPUs.")
CONNECT_RULE = (
    "NCCL connects two ranks lazily, in the first group in which they exchange, and both "
    "must then ask for the same connections: a send from one to the other in one rank's "
    "first group needs the matching receive in the other's first group, and nothing more. "
    "Otherwise the setup fails: between two ranks with \"Message truncated : received N "
    "bytes instead of M\" (NCCL's bootstrap); with more ranks it can hang. gloo has no such "
    "setup. Fix: begin each pair's exchanges with the same group on both sides, in which "
    "both send to and receive from each other (one element is enough).")


@dataclasses.dataclass(eq=False)
class _Op:
    event: CommEvent
    rank: int
    call: int                    # 1-based position in the rank's log
    stream: tuple[int, ...]      # the process group's ranks: its communicator and stream
    group: "_Group | None" = None
    partners: list["_Op"] | None = None   # the match (P2P) or the other members (collective)
    nth: int = 0                 # 1-based: the nth send a->b / receive at b from a / collective
    done: bool = False

    @property
    def kind(self) -> str:
        return ("send" if self.event.op in SENDS else "receive" if self.event.op in RECEIVES
                else "collective")

    def describe(self) -> str:
        e = self.event
        size = human_bytes(e.nbytes)
        if self.kind == "send":
            return f"{e.op} of {size} to rank {e.peer}"
        if self.kind == "receive":
            return f"{e.op} of {size} from rank {e.peer}"
        return f"{e.op} of {size} on ranks {list(self.stream)}"


@dataclasses.dataclass(eq=False)
class _Group:
    rank: int
    ops: list[_Op]
    batch: bool
    siblings: list["_Group"]     # every group of this rank, in order
    finished: bool = False

    @property
    def blocking(self) -> bool:
        return any(op.event.op == "barrier" for op in self.ops)

    def name(self) -> str:
        """Short: "its call 4", "its batch_isend_irecv of calls 1-3"."""
        first, last = self.ops[0].call, self.ops[-1].call
        if not self.batch:
            return f"its {self.ops[0].event.op} (call {first})"
        return f"its batch_isend_irecv of {f'call {first}' if first == last else f'calls {first}-{last}'}"

    def describe(self) -> str:
        """Long: the name and what is in it, identical operations counted."""
        if not self.batch:
            return f"its {self.ops[0].describe()} (call {self.ops[0].call})"
        counts = collections.Counter(op.describe() for op in self.ops)
        return f"{self.name()} ({', '.join(f'{n} x {d}' if n > 1 else d for d, n in counts.items())})"


def nccl_deadlock(logs) -> str | None:
    """None when the recorded calls of every rank would complete on NCCL; otherwise, in
    plain words, which rank's group is stuck waiting for what, and what the peer is doing
    instead (and any send and receive that NCCL would pair although their sizes differ).

    ``logs[r]`` is global rank r's :class:`~distlab.comm.CommLog` (or its ``records()``,
    or None for a rank that made no call), covering the same stretch of the program on
    every rank.
    """
    ops = _ops(logs)
    problems = _unsourced(ops) + _match(ops)
    mismatched = _connections(ops)
    if mismatched:
        problems.append("On NCCL the first connection between two ranks would fail:\n" +
                        "\n".join(f"- {line}" for line in mismatched) + "\n" + CONNECT_RULE)
    stuck = _simulate(ops)
    if stuck:
        problems.append("On NCCL this would hang:\n" + "\n".join(
            f"- {_why(group)}" for group in stuck) + "\n" + RULE)
    return "\n".join(problems) if problems else None


def _ops(logs) -> dict[int, list[_Op]]:
    """Every rank's P2P calls and collectives, in the order it made them, in groups."""
    out: dict[int, list[_Op]] = {}
    for rank, log in enumerate(logs):
        if log is None:
            events = []
        elif isinstance(log, CommLog):
            events = log.events
        else:
            events = CommLog.from_records(list(log), rank).events
        mine = []
        for call, e in enumerate(events, start=1):
            if e.op in SENDS + RECEIVES + COLLECTIVES:
                mine.append(_Op(e, rank, call, tuple(e.group_ranks)))
        groups: list[_Group] = []
        for op in mine:
            last = groups[-1] if groups else None
            if (last is not None and last.batch and op.event.batch is not None
                    and last.ops[-1].event.batch == op.event.batch):
                last.ops.append(op)
            else:
                groups.append(_Group(rank, [op], op.event.batch is not None, groups))
            op.group = groups[-1]
        out[rank] = mine
    return out


def _unsourced(ops) -> list[str]:
    return [f"rank {op.rank}'s {op.event.op} (call {op.call}) names no source rank: NCCL "
            f"cannot receive from any source; pass src= (or group_src=)"
            for mine in ops.values() for op in mine
            if op.kind == "receive" and op.event.peer is None][:1]


def _match(ops) -> list[str]:
    """Pair each send with the receive NCCL gives it, and each collective with the other
    members' of the same rank; returns the pairs whose sizes differ, in words."""
    sends, recvs, colls = (collections.defaultdict(list) for _ in range(3))
    for mine in ops.values():
        for op in mine:
            e = op.event
            if op.kind == "send":
                sends[(op.stream, op.rank, e.peer)].append(op)
            elif op.kind == "receive" and e.peer is not None:
                recvs[(op.stream, e.peer, op.rank)].append(op)
            elif op.kind == "collective":
                colls[(op.stream, op.rank)].append(op)
    mismatched = []
    for key in set(sends) | set(recvs):
        for n, op in enumerate(sends.get(key, []), start=1):
            op.nth = n
        for n, op in enumerate(recvs.get(key, []), start=1):
            op.nth = n
        for send, recv in zip(sends.get(key, []), recvs.get(key, [])):
            send.partners, recv.partners = [recv], [send]
            if send.event.nbytes != recv.event.nbytes:
                mismatched.append(
                    f"rank {send.rank}'s {_nth(send.nth)} send to rank {recv.rank} "
                    f"({send.describe()}, call {send.call}) meets rank {recv.rank}'s "
                    f"{_nth(recv.nth)} receive from rank {send.rank} ({recv.describe()}, call "
                    f"{recv.call}): the sizes differ. On NCCL the k-th send from one rank to "
                    f"another is received by the k-th receive there, and both must pass the "
                    f"same count and dtype.")
    for (stream, rank), mine in colls.items():
        for n, op in enumerate(mine):
            op.nth = n + 1
            others = [colls.get((stream, m), []) for m in stream if m != rank]
            if all(len(o) > n for o in others):
                op.partners = [o[n] for o in others]
    return sorted(mismatched)[:3]


def _connections(ops) -> list[str]:
    """In words, each pair of ranks whose first groups with each other use different
    directions (a direction is a (source, destination) pair of ranks)."""
    first = {}  # (stream, rank, peer) -> (its first group with peer, directions used)
    for mine in ops.values():
        for op in mine:
            e = op.event
            if op.kind == "collective" or e.peer is None or e.peer == op.rank:
                continue
            group, used = first.setdefault((op.stream, op.rank, e.peer), (op.group, set()))
            if op.group is group:
                used.add((op.rank, e.peer) if op.kind == "send" else (e.peer, op.rank))
    out = []
    for (stream, a, b), (ga, used_a) in sorted(first.items(), key=lambda kv: kv[0]):
        gb, used_b = first.get((stream, b, a), (None, set()))
        if a < b and gb is not None and used_a != used_b:
            out.append(f"rank {a}'s first exchange with rank {b} is {ga.describe()}, which "
                       f"{_uses(used_a, a)}; rank {b}'s first exchange with rank {a} is "
                       f"{gb.describe()}, which {_uses(used_b, b)}.")
    return out[:3]


def _uses(used: set[tuple[int, int]], rank: int) -> str:
    """What a group of ``rank``'s does with its peer, from the directions it uses."""
    (src, dst), *more = sorted(used)
    peer = dst if src == rank else src
    if more:
        return f"sends to and receives from rank {peer}"
    return f"only sends to rank {peer}" if src == rank else f"only receives from rank {peer}"


def _simulate(ops) -> list[_Group]:
    """Run the groups under NCCL's rules; the groups at the head of a stream that never
    end (empty when everything completes)."""
    queues: dict[tuple, collections.deque] = {}
    for rank, mine in ops.items():
        for group in (mine[0].group.siblings if mine else []):
            queues.setdefault((rank, group.ops[0].stream), collections.deque()).append(group)

    def running(group: _Group) -> bool:
        queue = queues[(group.rank, group.ops[0].stream)]
        if not queue or queue[0] is not group:
            return False
        for earlier in group.siblings:  # a barrier holds the host back
            if earlier is group:
                return True
            if earlier.blocking and not earlier.finished:
                return False
        return True

    progress = True
    while progress:
        progress = False
        for queue in queues.values():
            while queue and running(queue[0]):
                group = queue[0]
                for op in group.ops:
                    if not op.done and op.partners is not None and all(
                            running(p.group) for p in op.partners):
                        for p in [op, *op.partners]:
                            p.done = True
                if not all(op.done for op in group.ops):
                    break
                group.finished = True
                queue.popleft()
                progress = True
    return [queue[0] for _, queue in sorted(queues.items(), key=lambda kv: kv[0][0]) if queue]


def _why(group: _Group) -> str:
    """One stuck group, in words: what it waits for and what the peer does instead."""
    waiting = [op for op in group.ops if not op.done]
    if not group.batch:
        return f"rank {group.rank} is stuck in {group.describe()}, which {_needs(waiting[0])}."
    more = f" (and {len(waiting) - 1} more of its operations wait)" if len(waiting) > 1 else ""
    return (f"rank {group.rank} is stuck in {group.describe()}: its {waiting[0].describe()} "
            f"{_needs(waiting[0])}{more}.")


def _needs(op: _Op) -> str:
    e = op.event
    if op.kind == "collective":
        if op.partners is None:
            return (f"waits for every rank of {list(op.stream)} to call its {_nth(op.nth)} "
                    f"collective on that group, and not all of them ever do")
        late = [p for p in op.partners if p.group is not _head(p)]
        if late:
            p = late[0]
            return (f"waits for rank {p.rank}, which calls it only in call {p.call}, behind "
                    f"{_head(p).name()}, which cannot end")
        return "waits for the other ranks, which are stuck"
    other = "receive" if op.kind == "send" else "send"
    direction = f"from rank {op.rank}" if op.kind == "send" else f"to rank {op.rank}"
    if op.partners is None:
        return (f"is the {_nth(op.nth)} {op.kind} {_pair(op)}, but rank {e.peer} never posts "
                f"a {_nth(op.nth)} {other} {direction}")
    p = op.partners[0]
    head = _head(p)
    if head is p.group:
        return f"needs rank {e.peer}'s matching {p.event.op} in {p.group.name()}, stuck itself"
    return (f"needs rank {e.peer}'s matching {p.describe()} (call {p.call}), which rank "
            f"{e.peer} posts only later: it is still in {head.name()}, which cannot end")


def _head(op: _Op) -> _Group:
    """The group that holds up ``op``'s stream on its rank (its own when it runs)."""
    return next(g for g in op.group.siblings if g.ops[0].stream == op.stream and not g.finished)


def _pair(op: _Op) -> str:
    return f"to rank {op.event.peer}" if op.kind == "send" else f"from rank {op.event.peer}"


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
