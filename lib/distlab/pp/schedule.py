"""Pipeline schedules as tables: their format, their check, and an ideal clock.

A schedule is a table with one row per stage: the ordered list of that stage's
actions, ``("F", i)`` the forward of micro-batch ``i`` and ``("B", i)`` its backward.
:class:`distlab.pp.PipelineRunner` executes such a table exactly as written.
:func:`check_schedule` finds what keeps a table from running; :func:`simulate` plays a
table on an ideal clock (the same forward time and the same backward time on every
stage, free communication). The tables of GPipe and 1F1B and their bubble are lab 07's
exercises: :mod:`distlab.pp` re-exports the library's (``build_schedule``,
``gpipe_schedule``, ``one_f_one_b_schedule``, ``bubble_fraction``), whose
implementation lives in :mod:`distlab.pp.tables`.
"""
from __future__ import annotations

KINDS = ("F", "B")
TITLES = {"gpipe": "GPipe", "1f1b": "1F1B"}  # the schedules' names to print
Table = list[list[tuple[str, int]]]  # one row of actions per stage


def peak_in_flight(actions) -> int:
    """The most micro-batches one stage's action list holds at once (forwarded, not yet
    backwarded): the activations it must keep."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def check_schedule(table, num_stages: int | None = None,
                   num_microbatches: int | None = None) -> str | None:
    """The first problem of a schedule table, in plain words, or None when it can run.

    It checks the format (one list per stage of ``("F", i)``/``("B", i)``), that every
    stage runs each micro-batch's forward and backward once, the forward first, that
    each stage takes its messages in the order its neighbour sends them (between two
    ranks messages arrive in the order they were sent; NCCL has no tags), and, by
    playing the table (:func:`simulate`), that no stage waits forever."""
    if not isinstance(table, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in table):
        return (f"a schedule is a list with one list of actions per stage, got "
                f"{type(table).__name__}")
    p = len(table) if num_stages is None else num_stages
    if len(table) != p:
        return f"the table has {len(table)} rows but there are {p} stages: one row per stage"
    m = num_microbatches
    for s, actions in enumerate(table):
        for a in actions:
            if (not isinstance(a, (list, tuple)) or len(a) != 2 or a[0] not in KINDS
                    or isinstance(a[1], bool) or not isinstance(a[1], int)):
                return (f"stage {s}: {a!r} is not an action; an action is a tuple (kind, "
                        f"micro-batch) with kind 'F' or 'B' and an int micro-batch")
        if m is None:
            m = 1 + max((a[1] for a in actions), default=-1)
    for s, actions in enumerate(table):
        for kind in KINDS:
            mbs = [i for k, i in actions if k == kind]
            if sorted(mbs) != list(range(m)):
                twice = sorted({i for i in mbs if mbs.count(i) > 1})
                missing = sorted(set(range(m)) - set(mbs))
                extra = sorted(set(mbs) - set(range(m)))
                what = (f"runs {kind}{twice[0]} {mbs.count(twice[0])} times" if twice else
                        f"never runs {kind}{missing[0]}" if missing else
                        f"runs {kind}{extra[0]}, but micro-batches are numbered 0 to {m - 1}")
                return (f"stage {s} {what}: every stage runs the forward (F) and the backward "
                        f"(B) of each of the {m} micro-batches exactly once")
        order = {a: n for n, a in enumerate(map(tuple, actions))}
        for i in range(m):
            if order[("B", i)] < order[("F", i)]:
                return (f"stage {s} runs B{i} before F{i}: a backward needs the activations "
                        f"its forward saved")
    for s in range(1, p):
        for kind, src, dst, what in (("F", s - 1, s, "activations"), ("B", s, s - 1, "gradients")):
            sent = [i for k, i in table[src] if k == kind]
            taken = [i for k, i in table[dst] if k == kind]
            if sent != taken:
                return (f"stage {src} sends its {what} to stage {dst} in the order {sent} "
                        f"(its {kind}s) but stage {dst} runs its {kind}s in the order {taken}: "
                        f"between two ranks messages arrive in the order they were sent, so "
                        f"both must handle the micro-batches in the same order")
    _, stuck = _play(table, 1.0, 1.0, 0.0)
    return stuck


def simulate(table, forward_time: float = 1.0, backward_time: float = 2.0,
             transfer_time: float = 0.0) -> list[dict]:
    """Play a table on an ideal clock: every forward takes ``forward_time``, every
    backward ``backward_time``, every message between stages ``transfer_time`` (free by
    default: the sender waits for it to leave, as in the runtime's grouped transfers,
    and the receiver for it to arrive), and each action starts as soon as its stage is
    free and its input has arrived. Returns the timeline as events
    ``{"stage", "kind", "mb", "start", "end"}`` (the format of
    :mod:`distlab.pp.events`); raises ValueError when the table cannot run."""
    problem = check_schedule(table)
    if problem:
        raise ValueError(f"this schedule cannot run: {problem}")
    events, _ = _play(table, forward_time, backward_time, transfer_time)
    return events


def _play(table, tf: float, tb: float, tc: float) -> tuple[list[dict], str | None]:
    """Run every stage's list in order; F(s, i) waits for F(s-1, i), B(s, i) for
    B(s+1, i). Returns the events and, when stuck, what each stuck stage waits for."""
    p = len(table)
    done: dict[tuple[str, int, int], float] = {}
    nxt, free, live, events = [0] * p, [0.0] * p, [0] * p, []
    while True:
        progress = False
        for s in range(p):
            while nxt[s] < len(table[s]):
                kind, i = table[s][nxt[s]]
                dep = (kind, s - 1, i) if kind == "F" else (kind, s + 1, i)
                if not 0 <= dep[1] < p:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep] + tc
                else:
                    break
                start = max(free[s], ready)
                done[(kind, s, i)] = start + (tf if kind == "F" else tb)
                sends = 0 <= (s + 1 if kind == "F" else s - 1) < p
                free[s] = done[(kind, s, i)] + (tc if sends else 0.0)
                live[s] += 1 if kind == "F" else -1
                events.append({"stage": s, "kind": kind, "mb": i, "start": start,
                               "end": done[(kind, s, i)], "live": live[s]})
                nxt[s] += 1
                progress = True
        if all(nxt[s] == len(table[s]) for s in range(p)):
            return events, None
        if not progress:
            waits = []
            for s in range(p):
                if nxt[s] < len(table[s]):
                    kind, i = table[s][nxt[s]]
                    peer, what = (s - 1, "activation") if kind == "F" else (s + 1, "gradient")
                    waits.append(f"stage {s} waits in {kind}{i} for the {what} of micro-batch "
                                 f"{i} from stage {peer}")
            return events, "deadlock: " + "; ".join(waits) + " (each waits for another)"
