"""Every rank's flight record, as plain data, and runs that hang the ways production
runs do. PyTorch's flight recorder keeps, in each process, a ring buffer of the last
collectives it issued, on gloo as on NCCL; in torch 2.13 it records by default, and
``TORCH_FR_BUFFER_SIZE``, read when the process creates its first process group, sets
how many entries it keeps.

A record is ``{"dropped": n, "entries": [...]}``: ``dropped`` entries older than the
first kept one were lost to the ring buffer, and each entry is ``{"group", "seq", "op",
"sizes", "dtypes", "state", "time_ns"}``: the process group's name, the collective's
sequence number in that group (from 1), the op (``all_reduce``, ``broadcast``, ...), its
input sizes and dtypes, the recorder's state, and when it was issued.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import pickle
import re
import tempfile

import torch
import torch.distributed as dist

from distlab.comm import CommLog

logging.disable(logging.WARNING)   # the analyzer's "tabulate is not installed" at import
try:
    from torch.distributed.flight_recorder import fr_trace
finally:
    logging.disable(logging.NOTSET)

HANGS = ("skip", "size", "op")


def keep_last(raw: bytes, entries: int) -> bytes:
    """The dump ``raw`` as a recorder keeping only its last ``entries`` entries would
    hold it (the kit's warm ranks started their recorders long before)."""
    full = pickle.loads(raw)
    kept = full["entries"][-entries:]
    lost = len(full["entries"]) - len(kept)
    return pickle.dumps(dict(full, entries=kept, dropped=full.get("dropped", 0) + lost))


def dump(groups: dict) -> bytes:
    """This rank's recorder as its dump file holds it (what the analyzer reads), kept to
    the entries of ``groups`` (process group → the name to give it: a warm rank's
    recorder also holds earlier runs' groups), with each group's ranks in ``pg_config``
    (gloo's dumps in torch 2.13 give those of no group but the default one)."""
    full = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    names = {g.group_name: name for g, name in groups.items()}
    entries = [dict(e, process_group=(e["process_group"][0], names[e["process_group"][0]]))
               for e in full["entries"] if e["process_group"][0] in names]
    for number, e in enumerate(entries):    # numbered as if these groups were all it saw
        e["record_id"] = number
    config = {g.group_name: {"name": g.group_name, "desc": name,
                             "ranks": str(dist.get_process_group_ranks(g))}
              for g, name in groups.items()}
    dropped = full["entries"][0]["record_id"] if full["entries"] else 0
    return pickle.dumps(dict(full, entries=entries, pg_config=config, dropped=dropped))


def record(raw: bytes) -> dict:
    """A rank's flight record from its dump ``raw`` (:func:`dump`: each group under the
    name it was given)."""
    dump = pickle.loads(raw)
    entries = [e for e in dump["entries"] if not e["is_p2p"]]
    dropped = dump.get("dropped", dump["entries"][0]["record_id"] if dump["entries"] else 0)
    return {"dropped": dropped, "entries": [
        {"group": e["process_group"][1], "seq": e["collective_seq_id"],
         "op": e["profiling_name"].split(":")[-1], "sizes": e["input_sizes"],
         "dtypes": e["input_dtypes"], "state": e["state"], "time_ns": e["time_created_ns"]}
        for e in entries]}


def hang(kind: str, culprit: int, timeout_s: float = 1.0, steps: int = 3) -> dict:
    """In every rank: a few data-parallel steps (an all-reduce of the gradient, a
    broadcast, an all-reduce of the loss) on a group of their own, in which rank
    ``culprit``'s step ``steps - 1`` goes wrong: ``skip`` leaves out the gradient's
    all-reduce, ``size`` sends one element fewer, ``op`` broadcasts instead. Every rank
    waits at most ``timeout_s`` for a collective; returns this rank's flight record and
    its dump and the error that ended its run (None: it finished)."""
    if kind not in HANGS:
        raise ValueError(f"kind must be one of {HANGS}, got {kind!r}")
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    wrong = dist.get_rank() == culprit
    error = None
    try:
        for step in range(steps):
            grad, loss = torch.ones(6), torch.ones(1)
            last = wrong and step == steps - 1
            if last and kind == "size":
                grad = torch.ones(5)
            if last and kind == "op":
                dist.broadcast(grad, 0, group=group)
            elif not (last and kind == "skip"):
                dist.all_reduce(grad, group=group)
            dist.broadcast(torch.zeros(2), 0, group=group)
            dist.all_reduce(loss, group=group)
    except Exception as exc:  # gloo's timeout, or a peer's error
        error = str(exc).splitlines()[0][:160]
    raw = dump({group: "dp"})
    return {"record": record(raw), "dump": raw, "error": error}


def one_f_one_b(microbatches: int, fused: bool = True) -> list[dict]:
    """This rank's stage of one 1F1B step, its transfers ordered as PyTorch's
    ``Schedule1F1B`` (``torch.distributed.pipelining``) orders them: stage s of p runs
    min(m, p - s) forwards first, its last forward's send fused into one
    ``batch_isend_irecv`` with its first backward's receive; then a backward and a
    forward in turn, each backward's send fused with the next forward's receive, and
    each forward's send with the next backward's receive. ``fused=False`` issues each
    batch's operations one by one instead, its sends first. Activations and gradients
    are 4 numbers (the computation is beside the point); returns this rank's
    :class:`~distlab.comm.CommLog` records. With one micro-batch, fewer than the stages,
    each stage's first exchange with the next both sends and receives while the next's
    only receives: NCCL's connection setup fails or hangs (torchtitan issue 775; since
    PyTorch pull request 144702 the schedule refuses m < p)."""
    s, p, m = dist.get_rank(), dist.get_world_size(), microbatches
    if m < 1:
        raise ValueError(f"need at least one micro-batch, got {m}")

    def ops(kind, peer):
        if not 0 <= peer < p:
            return []
        op = dist.isend if kind == "send" else dist.irecv
        return [dist.P2POp(op, torch.zeros(4), peer)]

    def exchange(batch):
        if batch and fused:
            works = dist.batch_isend_irecv(batch)
        else:
            works = [o.op(o.tensor, o.peer) for o in sorted(batch, key=lambda o: o.op is not dist.isend)]
        for work in works:
            work.wait()

    warmup, forwards, backwards, sends = min(m, p - s), 0, 0, []
    with CommLog() as log:
        for _ in range(warmup):
            exchange(ops("recv", s - 1))
            sends, forwards = ops("send", s + 1), forwards + 1
            if forwards < warmup:
                exchange(sends)
                sends = []
        while True:
            exchange(sends + ops("recv", s + 1))          # this backward's gradient
            sends, backwards = ops("send", s - 1), backwards + 1
            if forwards == m:
                break
            exchange(sends + ops("recv", s - 1))          # the next forward's activation
            sends, forwards = ops("send", s + 1), forwards + 1
        exchange(sends)
        while backwards < m:
            exchange(ops("recv", s + 1))
            exchange(ops("send", s - 1))
            backwards += 1
    return log.records()


_ERRORS = re.compile(r"Collective sequence number: (\d+) has errors\ninternal record id: "
                     r"\d+\ngroup info: (.+?)\n.*?error msg: (.*?)\n", re.DOTALL)
_MISSING = re.compile(r"Not all ranks joining collective, sequence number: (\d+)\ninternal "
                      r"record id: \d+\ngroup info: (.+?)\n.*?missing ranks: \{(.*?)\}", re.DOTALL)


def analyze(dumps: list[bytes]) -> list[dict]:
    """What PyTorch's analyzer (``torch.distributed.flight_recorder.fr_trace``) finds in
    every rank's dump (:func:`dump`): per collective with errors, its group, its
    sequence number, the culprit ranks it names and its message."""
    with tempfile.TemporaryDirectory() as folder:
        for rank, raw in enumerate(dumps):
            with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
                f.write(raw)
        text = io.StringIO()
        handler = logging.StreamHandler(text)
        logger = logging.getLogger("Flight Recorder")
        level, propagate, handlers = logger.level, logger.propagate, list(logger.handlers)
        for h in handlers:
            logger.removeHandler(h)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                fr_trace.main([folder])
        finally:
            logger.removeHandler(handler)
            for h in handlers:
                logger.addHandler(h)
            logger.setLevel(level)
            logger.propagate = propagate
    log = text.getvalue()
    found = [{"seq": int(seq), "group": group.split(":", 1)[-1], "culprits": sorted(
              {int(r) for r in re.findall(r"Culprit rank (\d+)", message)}), "message": message}
             for seq, group, message in _ERRORS.findall(log)]
    found += [{"seq": int(seq), "group": group.split(":", 1)[-1], "culprits": sorted(
               int(r) for r in ranks.split(",") if r.strip()), "message": "missing ranks"}
              for seq, group, ranks in _MISSING.findall(log)]
    return sorted(found, key=lambda f: (f["group"], f["seq"]))
