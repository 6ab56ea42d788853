"""What lab 12's exercise tests share: replicas of a small fp64 model trained by a
student's ``fault_tolerant_step``, each replica a launch of its own meeting the others on
a lighthouse served here; one replica SIGKILLed in the middle of an all-reduce, and a
replacement that rejoins later; and the one-process run over the same samples."""
import pickle
import sys

import cloudpickle
import torch
import torch.nn as nn

from distlab.resilience import flight
from distlab.resilience.replicas import run as replicas_run

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas get the job by value

STEPS, KILL_AT, REJOIN_AT = 5, 1, 3
FEATURES, CLASSES = 6, 3


def model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()


def optimizer(net):
    return torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.01)


def batch(replica, step):
    """Replica ``replica``'s samples of ``step``: 2 + replica rows (batches differ in size)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    rows = 2 + replica
    return (torch.randn(rows, FEATURES, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (rows,), generator=g))


def loss_fn(net, data):
    return nn.functional.cross_entropy(net(data[0]), data[1])


def state(net, opt):
    """Weights and optimizer state as plain tensors, in a fixed order."""
    found = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        for key, value in sorted(opt.state.get(p, {}).items()):
            found.append(value.detach().clone().reshape(-1).double())
    return found


JOB = {"model": model, "optimizer": optimizer, "batch": batch, "loss": loss_fn,
       "state": state, "steps": STEPS, "rejoin_at": REJOIN_AT, "seed": 7, "timeout_s": 2.0}


def run(step_fn, replicas):
    """{replica: what it returned, or its launch's error}, "replacement" included: the
    last replica killed in step KILL_AT, a fresh one in its place (the others wait for it before REJOIN_AT)."""
    return replicas_run(step_fn, replicas, JOB, kill_in_step=KILL_AT)


def one_process(committed):
    """The losses and final state of one process on the same samples: ``committed`` is
    the list of (step, members) of each committed step, in order."""
    net = model(seed=7)
    opt = optimizer(net)
    losses = []
    for step, members in committed:
        xs, ys = zip(*(batch(m, step) for m in members))
        opt.zero_grad()
        loss = loss_fn(net, (torch.cat(xs), torch.cat(ys)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, state(net, opt)


# ------------------------------------------------ first_divergence: generated flight records

SIZES = {"all_reduce": [[6]], "broadcast": [[2]]}


def simulate(programs, groups, buffer=None):
    """Every rank's flight-recorder dump (the recorder's own format) after the ranks run
    ``programs`` (per rank, its calls ``(group, op, sizes)``) until they finish or hang:
    a rank issues its next call once its last one completed, which happens when every
    member of the group issued the same call at the same sequence number. Ranks take
    turns; the clock ticks once per issued call. ``buffer``: entries each rank keeps."""
    world = len(programs)
    pc, seq = [0] * world, [dict() for _ in range(world)]
    issued, waiting, entries, clock = {}, [None] * world, [[] for _ in range(world)], 0
    moved = True
    while moved:
        moved = False
        for r in range(world):
            if waiting[r] is not None:
                calls = issued[waiting[r]]
                if set(calls) != set(groups[waiting[r][0]]) or len(set(calls.values())) > 1:
                    continue
                waiting[r] = None
            if pc[r] == len(programs[r]):
                continue
            group, op, sizes = programs[r][pc[r]]
            pc[r] += 1
            n = seq[r][group] = seq[r].get(group, 0) + 1
            clock += 1
            issued.setdefault((group, n), {})[r] = (op, repr(sizes))
            waiting[r], moved = (group, n), True
            entries[r].append({
                "record_id": len(entries[r]), "pg_id": list(groups).index(group),
                "process_group": (str(list(groups).index(group)), group), "thread_name": "python",
                "thread_id": "1", "collective_seq_id": n, "p2p_seq_id": 0, "op_id": n,
                "profiling_name": f"gloo:{op}", "time_created_ns": 1000 * clock,
                "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes),
                "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes),
                "state": "scheduled", "time_discovered_started_ns": None,
                "time_discovered_completed_ns": None, "retired": True, "timeout_ms": 1000,
                "is_p2p": False, "frames": []})
    config = {str(i): {"name": str(i), "desc": g, "ranks": str(sorted(m))}
              for i, (g, m) in enumerate(groups.items())}
    return [pickle.dumps({"version": "2.10", "pg_config": config, "pg_status": {},
                          "comm_lib_version": "gloo", "entries": e[-buffer:] if buffer else e})
            for e in entries]


def program(world, steps, groups):
    """A data-parallel run's calls on each rank: per step the gradient's all-reduce and a
    broadcast on the world's group, then an all-reduce in each other group it belongs to."""
    calls = []
    for _ in range(steps):
        calls.append(("dp", "all_reduce", SIZES["all_reduce"]))
        calls.append(("dp", "broadcast", SIZES["broadcast"]))
        calls.extend((g, "all_reduce", [[3]]) for g in groups if g != "dp")
    return [[c for c in calls if r in groups[c[0]]] for r in range(world)]


def mutate(calls, index, kind):
    """``calls`` with call ``index`` skipped, resized, of another op, or an extra call
    before it."""
    group, op, sizes = calls[index]
    changed = {"skip": [], "size": [(group, op, [[sizes[0][0] + 1]])],
               "op": [(group, "broadcast" if op != "broadcast" else "all_reduce", sizes)],
               "extra": [(group, "all_reduce", [[5]]), calls[index]]}[kind]
    return calls[:index] + changed + calls[index + 1:]


def scenarios():
    """Generated hangs at world sizes 2 to 8, each ``{"what", "kind", "records", "groups",
    "dumps", "expected"}``; ``expected`` is where we made the ranks part: the culprit,
    the group and the sequence number of the call we changed (None: we changed none).
    Kinds: ``dp`` (one rank's gradient all-reduce of the second step skipped, resized,
    of another op, or a call too many before it), ``dropped`` (the same, each rank's
    buffer keeping its last 4 entries), ``member`` (a subgroup's last call skipped: the
    ranks outside it have finished), ``consequence`` (a subgroup's first call resized:
    the ranks outside it then wait on the world's group for its members), ``agree`` (no
    fault; in full, and with buffers of 2 entries)."""
    made = []
    for world in range(2, 9):
        groups = {"dp": list(range(world))}
        if world >= 4:
            groups["tp"] = list(range(1, world, 2))     # odd ranks: rank 0 is not a member
        base = program(world, 3, groups)
        for i, kind in enumerate(("skip", "size", "op", "extra")):
            culprit = 1 if world == 2 else (i + world) % world
            index = base[culprit].index(("dp", "all_reduce", SIZES["all_reduce"]), 2)
            made.append(("dropped" if kind in ("size", "extra") else "dp",
                         f"{world} ranks, rank {culprit}: {kind} in the second step's all-reduce",
                         groups, base, culprit, index, kind))
        if "tp" in groups:
            culprit = groups["tp"][-1]
            made.append(("consequence", f"{world} ranks, rank {culprit} resizes tp's first "
                         f"all-reduce", groups, base, culprit, 2, "size"))
        if "tp" in groups and len(groups["tp"]) >= 3:
            culprit = groups["tp"][-1]
            made.append(("member", f"{world} ranks, rank {culprit} skips tp's last all-reduce",
                         groups, base, culprit, len(base[culprit]) - 1, "skip"))
        made.append(("agree", f"{world} ranks, no fault", groups, base, None, None, None))
        made.append(("agree", f"{world} ranks, no fault, buffers of 2 entries", groups, base,
                     None, None, None))
    found = []
    for kind, what, groups, base, culprit, index, change in made:
        programs = [list(calls) for calls in base]
        expected = None
        if culprit is not None:
            group = programs[culprit][index][0]
            seq = 1 + sum(c[0] == group for c in programs[culprit][:index])
            programs[culprit] = mutate(programs[culprit], index, change)
            expected = {"rank": culprit, "group": group, "seq": seq}
        buffer = 4 if kind == "dropped" else 2 if "buffers" in what else None
        dumps = simulate(programs, groups, buffer)
        found.append({"what": what, "kind": kind, "records": [flight.record(d) for d in dumps],
                      "groups": groups, "dumps": dumps, "expected": expected})
    return found
