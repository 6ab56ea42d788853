"""nccl-tests-style sweeps: time, algbw and busbw per message size, and an alpha-beta fit.

    python -m distlab.bench.collectives                      # 4 ranks, every op, 4 KiB .. 16 MiB
    python -m distlab.bench.collectives --ops all_reduce --world-size 2 --max-bytes 64M
    python -m distlab.bench.collectives -n 2 --backend nccl -b 8 -e 1G --nccl-tests DIR  # side by side
    python -m distlab.bench.collectives -n 2 --backend nccl -b 8 -e 1G --api nccl  # NCCL without torch

Timing follows nccl-tests: warm-up calls, then a run of calls back to back, with no
barrier and no wait between them, timed as a whole (:func:`distlab.bench.timing.time_op`); the time per op
is the run's over its length. Waiting for each call instead adds the cost of issuing
it and of synchronising to every op, which for small messages is most of it
(:func:`~distlab.bench.timing.time_each`, the "1 call" column). ``--repeats R`` makes R such runs per size
and reports their median, and the fastest beside it: one run can be hit by a hiccup
of the machine, the median of several rarely is.

Where the GPU is faster than the host, back to back is not enough. Each call through
torch's Python API costs the host its own time (argument checks, the dispatch to the
process group, the work object: 25-40 us per call on the H200 machines), which
nccl-tests' C loop does not pay; a collective that takes the GPU less than that runs
at the host's pace, and the time per op is the host's. That is what a Python program
really pays per call, and worth knowing (lab 01). Two ways take it out:
``--api nccl`` calls NCCL itself through ``cupy.cuda.nccl`` with every argument worked
out beforehand (:mod:`distlab.collectives.nccl_raw`), so that a call costs the host about what it
costs nccl-tests, and the time per op is NCCL's, as nccl-tests measures it; ``--graph``
captures torch's calls in a CUDA graph and replays them: no host work per call at all.

Definitions follow nccl-tests (doc/PERFORMANCE.md): ``size`` is the message in bytes
(the whole buffer of all_reduce/broadcast/reduce, the *output* of all_gather, the
*input* of reduce_scatter), ``algbw = size / time`` and ``busbw = algbw * factor(n)``
with nccl-tests' factors (:func:`distlab.comm.bus_factor`), so that busbw is the
bandwidth one link carried and can be compared with the hardware's peak. :func:`sweep`
and :func:`run` take the function that computes it (``bus_bandwidth=``): lab 01 passes
its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics

import torch
import torch.distributed as dist

from distlab import backend, comm, launch
from distlab.alphabeta import fits
from distlab.bench.timing import time_each, time_runs
from distlab.collectives import bandwidth as busbw


OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv")
IN_PLACE = ("all_reduce", "broadcast", "reduce")  # as torch calls them; the others are not


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a sweep, as nccl-tests prints it (bandwidths in bytes/s)."""

    op: str
    size: int          # bytes, as nccl-tests counts them (see the module docstring)
    count: int         # elements of that message
    dtype: str
    seconds: float     # per op, back to back (time_op), slowest rank; median of the runs
    algbw: float
    busbw: float
    each: float | None = None     # one call waited for (time_each), if measured
    fastest: float | None = None  # the fastest of the runs, if more than one


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Message sizes min, min*factor, ... up to max (nccl-tests' -b, -e, -f)."""
    if not 0 < min_bytes <= max_bytes or factor < 2:
        raise ValueError(f"need 0 < min_bytes <= max_bytes and factor >= 2, got "
                         f"{min_bytes}, {max_bytes}, {factor}")
    out = [min_bytes]
    while out[-1] * factor <= max_bytes:
        out.append(out[-1] * factor)
    return out


def _op(op: str, nbytes: int, dtype: torch.dtype, group, raw=None):
    """(call, count): a closure running ``op`` once on buffers made here, and the
    element count of its message. Sizes round down to what the op can split evenly.
    The calls bypass CommLog's tracer (:func:`distlab.comm.untraced`); with ``raw``, a
    ``cupy.cuda.nccl`` communicator, they go straight to NCCL (:func:`_raw_op`)."""
    n = dist.get_world_size(group)
    device = backend.device()
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = max(nbytes // itemsize, 1)
    if op in ("all_gather", "reduce_scatter"):
        count = max(count // n, 1) * n
    root = dist.get_global_rank(group, 0) if group is not None else 0

    def buffer(numel):
        return torch.ones(numel, dtype=dtype, device=device)

    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    if op == "sendrecv" and n < 2:
        raise ValueError("sendrecv needs at least 2 ranks (each sends to the next)")
    if raw is not None:
        return _raw_op(op, count, buffer, raw), count
    if op == "all_reduce":
        t, all_reduce = buffer(count), comm.untraced(dist.all_reduce)
        call = lambda: all_reduce(t, group=group)  # noqa: E731
    elif op == "all_gather":
        out, inp = buffer(count), buffer(count // n)
        gather = comm.untraced(comm.single_tensor_op("all_gather"))
        call = lambda: gather(out, inp, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        out, inp = buffer(count // n), buffer(count)
        scatter = comm.untraced(comm.single_tensor_op("reduce_scatter"))
        call = lambda: scatter(out, inp, group=group)  # noqa: E731
    elif op == "broadcast":
        t, bcast = buffer(count), comm.untraced(dist.broadcast)
        call = lambda: bcast(t, src=root, group=group)  # noqa: E731
    elif op == "reduce":
        t, reduce = buffer(count), comm.untraced(dist.reduce)
        call = lambda: reduce(t, dst=root, group=group)  # noqa: E731
    else:
        call = _sendrecv(buffer(count), buffer(count), group)
    return call, count


def _raw_op(op: str, count: int, buffer, nc):
    """``op`` as one call on ``nc``, a ``cupy.cuda.nccl`` communicator, on buffers made by
    ``buffer(numel)``, its arguments (raw pointers, counts, datatype, the current stream)
    worked out here, so that a call costs the host what nccl-tests' C loop pays plus one
    Python call: the time per op is NCCL's own, where torch's API adds its Python and
    C++ per call."""
    from distlab.collectives import nccl_raw

    m, n, rank = nccl_raw.nccl(), nc.size(), nc.rank_id()
    stream = torch.cuda.current_stream().cuda_stream
    if op in ("all_reduce", "broadcast", "reduce"):
        t = buffer(count)
        ptr, numel, dt = nccl_raw.pointer(t)
        args = {"all_reduce": (nc.allReduce, ptr, ptr, numel, dt, m.NCCL_SUM, stream),
                "broadcast": (nc.broadcast, ptr, ptr, numel, dt, 0, stream),
                "reduce": (nc.reduce, ptr, ptr, numel, dt, m.NCCL_SUM, 0, stream)}[op]
        return _holding(functools.partial(*args), t)
    if op in ("all_gather", "reduce_scatter"):
        small, big = buffer(count // n), buffer(count)
    if op == "all_gather":
        send, numel, dt = nccl_raw.pointer(small)
        return _holding(functools.partial(nc.allGather, send, nccl_raw.pointer(big)[0],
                                          numel, dt, stream), small, big)
    if op == "reduce_scatter":
        recv, numel, dt = nccl_raw.pointer(small)
        return _holding(functools.partial(nc.reduceScatter, nccl_raw.pointer(big)[0], recv,
                                          numel, dt, m.NCCL_SUM, stream), small, big)
    a, b = buffer(count), buffer(count)
    (send, numel, dt), recv = nccl_raw.pointer(a), nccl_raw.pointer(b)[0]
    nxt, prv = (rank + 1) % n, (rank - 1) % n

    def call():  # nccl-tests' sendrecv: one group, send to the next, receive from the previous
        m.groupStart()
        nc.send(send, numel, dt, nxt, stream)
        nc.recv(recv, numel, dt, prv, stream)
        m.groupEnd()
    return _holding(call, a, b)


def _holding(call, *tensors):
    """``call``, keeping alive the tensors whose raw pointers it was given."""
    call.buffers = tensors
    return call


def _sendrecv(send: torch.Tensor, recv: torch.Tensor, group):
    """Send to the next rank and receive from the previous one, as one group where the
    backend groups calls (NCCL: what ``batch_isend_irecv`` does, without its per-call
    Python); gloo runs the two calls side by side."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    peers = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    nxt, prv = peers[(rank + 1) % n], peers[(rank - 1) % n]
    isend, irecv = comm.untraced(dist.isend), comm.untraced(dist.irecv)
    pg = group or dist.group.WORLD
    if pg._get_backend(send.device).supports_coalescing:
        from torch.distributed.distributed_c10d import _coalescing_manager

        def call():
            with _coalescing_manager(group, send.device, async_ops=True) as cm:
                isend(send, nxt, group)
                irecv(recv, prv, group)
            cm.wait()
    else:
        def call():
            for work in (isend(send, nxt, group), irecv(recv, prv, group)):
                work.wait()
    return call


def sweep(ops=OPS, message_sizes=None, dtype: torch.dtype = torch.float32, warmup: int = 5,
          iters: int = 20, group=None, each: int = 0, graph: bool = False,
          repeats: int = 1, api: str = "torch",
          bus_bandwidth=busbw.bus_bandwidth) -> list[Row]:
    """Time every op at every size on the ranks of ``group`` (the median of ``repeats``
    runs of :func:`~distlab.bench.timing.time_op`, and with ``each`` > 0 also :func:`~distlab.bench.timing.time_each` over that many
    calls); call it on each of them (inside a launched function). Every rank returns
    the same rows. sendrecv is left out on a single rank (it has no peer).

    ``api``: ``"torch"`` calls torch.distributed, as the labs do; ``"nccl"`` calls NCCL
    itself through ``cupy.cuda.nccl`` (:mod:`distlab.collectives.nccl_raw`) on a communicator of
    every rank, as nccl-tests does (NCCL backend and the default group only).

    ``bus_bandwidth(op, nbytes, seconds, world_size)`` gives each row's busbw in bytes/s
    (default: the library's, nccl-tests' factors)."""
    message_sizes = message_sizes or sizes(4 << 10, 16 << 20)
    n = dist.get_world_size(group)
    ops = [op for op in ops if not (op == "sendrecv" and n < 2)]
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    raw = _raw_communicator(api, group, graph)
    cases = [(op, size) for op in ops for size in message_sizes]
    rows = []
    for op, size in launch.progress(cases, desc=f"bench on {n} rank(s)"):
        call, count = _op(op, size, dtype, group, raw)
        runs = time_runs(call, warmup, iters, group, graph, repeats)
        seconds = statistics.median(runs)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        rows.append(Row(op, nbytes, count, str(dtype).removeprefix("torch."), seconds,
                        nbytes / seconds, bus_bandwidth(op, nbytes, seconds, n),
                        time_each(call, each, group) if each else None,
                        min(runs) if repeats > 1 else None))
        del call  # free this size's buffers before the next
    return rows


APIS = ("torch", "nccl")


def _raw_communicator(api: str, group, graph: bool):
    """The ``cupy.cuda.nccl`` communicator that ``api="nccl"`` calls (None for torch's
    API), or a ValueError that says what to change."""
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    if api == "torch":
        return None
    if dist.get_backend(group) != "nccl":
        raise ValueError(f"api='nccl' calls NCCL itself, which needs GPUs and the nccl "
                         f"backend (launched with {dist.get_backend(group)}); use "
                         f"api='torch' (--api torch) here")
    if group is not None:
        raise ValueError("api='nccl' builds one communicator of every rank: pass group=None")
    if graph:
        raise ValueError("graph=True takes the host's cost per call out of torch's API; "
                         "api='nccl' already pays only NCCL's own: use one or the other")
    from distlab.collectives import nccl_raw

    return nccl_raw.communicator()


def table(rows: list[Row]) -> str:
    """nccl-tests' columns (time per op in us, bandwidths in GB/s = 1e9 B/s), one block
    per op, each followed by its alpha-beta fit; with several runs per size, the
    fastest run's time ("min(us)"); with :func:`time_each` measured, the time of one
    call waited for ("1 call(us)")."""
    fitted = fits(rows)
    each = any(r.each is not None for r in rows)
    fastest = any(r.fastest is not None for r in rows)
    header = (f"{'size':>12} {'count':>12} {'type':>8} {'time(us)':>11} {'algbw(GB/s)':>12} "
              f"{'busbw(GB/s)':>12}" + (f" {'min(us)':>11}" if fastest else "")
              + (f" {'1 call(us)':>11}" if each else ""))
    lines = []
    for op in dict.fromkeys(r.op for r in rows):
        lines += [f"# {op}", "#" + header[1:]]
        lines += [f"{r.size:>12} {r.count:>12} {r.dtype:>8} {r.seconds * 1e6:>11.1f} "
                  f"{r.algbw / 1e9:>12.3f} {r.busbw / 1e9:>12.3f}"
                  + (f" {r.fastest * 1e6:>11.1f}" if r.fastest is not None else "")
                  + (f" {r.each * 1e6:>11.1f}" if r.each is not None else "")
                  for r in rows if r.op == op]
        if op in fitted and fitted[op].bandwidth == float("inf"):
            lines.append(f"# alpha-beta fit: latency {fitted[op].alpha * 1e6:.1f} us and no "
                         f"size dependence: nothing crossed a link (one rank?)")
        elif op in fitted:
            f = fitted[op]
            lines.append(f"# alpha-beta fit: latency {f.alpha * 1e6:.1f} us, algbw "
                         f"{f.bandwidth / 1e9:.3f} GB/s (busbw {f.busbw / 1e9:.3f} GB/s), "
                         f"latency = transfer at {comm.human_bytes(f.half_size)}")
        lines.append("")
    return "\n".join(lines).rstrip()


def run(ops=OPS, message_sizes=None, world_size: int = 4, backend: str = "auto",
        dtype: torch.dtype = torch.float32, warmup: int = 5, iters: int = 20,
        timeout: float = 600.0, each: int = 0, graph: bool = False,
        repeats: int = 1, api: str = "torch") -> list[Row]:
    """Launch ``world_size`` ranks and sweep; the rows (from rank 0)."""
    return launch.run(sweep, world_size, tuple(ops), message_sizes, dtype, warmup, iters,
                      None, each, graph, repeats, api, backend=backend, timeout=timeout)[0]


# ------------------------------------------------------------ nccl-tests, side by side


@dataclasses.dataclass(frozen=True)
class NcclTestsRow:
    """One line of an nccl-tests ``*_perf`` run: its out-of-place and in-place times
    (seconds) and bandwidths (bytes/s)."""

    size: int
    count: int
    dtype: str
    out_of_place: float
    in_place: float
    busbw_out_of_place: float
    busbw_in_place: float

    def seconds(self, op: str) -> float:
        """The time of the variant torch's call of ``op`` is: in place for all_reduce,
        broadcast and reduce, out of place for the others (as :func:`sweep` runs them)."""
        return self.in_place if op in IN_PLACE else self.out_of_place


def read_nccl_tests(text: str) -> list[NcclTestsRow]:
    """The result lines of an nccl-tests output (``all_reduce_perf -b 8 -e 1G ...``):
    size count type redop root, then time algbw busbw #wrong out of place, the same in
    place (times in us, bandwidths in GB/s, as printed)."""
    rows = []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) < 13 or line.lstrip().startswith("#") or not cells[0].isdigit():
            continue
        rows.append(NcclTestsRow(int(cells[0]), int(cells[1]), cells[2], float(cells[5]) / 1e6,
                                 float(cells[9]) / 1e6, float(cells[7]) * 1e9,
                                 float(cells[11]) * 1e9))
    if not rows:
        raise ValueError("no result lines in this nccl-tests output (is it the output of an "
                         "*_perf binary?)")
    return rows


def compare(rows: list[Row], reference: dict[str, list[NcclTestsRow]]) -> list[dict]:
    """Per op and size measured by both: our time per op, nccl-tests', and their ratio
    (ours / nccl-tests', so 1.15 means 15 % slower; with several runs, also that of our
    fastest run, "best_ratio"). Sizes match exactly or to the nearest within 10 %
    (nccl-tests rounds some sizes to what splits evenly)."""
    out = []
    for r in rows:
        theirs = reference.get(r.op, [])
        near = min(theirs, key=lambda t: abs(t.size - r.size), default=None)
        if near is None or abs(near.size - r.size) > 0.1 * r.size:
            continue
        seconds = near.seconds(r.op)
        out.append({"op": r.op, "size": r.size, "seconds": r.seconds,
                    "nccl_tests_seconds": seconds, "ratio": r.seconds / seconds,
                    "best_ratio": None if r.fastest is None else r.fastest / seconds})
    return out


def comparison_table(compared: list[dict]) -> str:
    """Time per op side by side, one block per op, and each op's worst ratio (with
    several runs, the ratio of our fastest run too, "best")."""
    lines = []
    best = any(c.get("best_ratio") is not None for c in compared)
    for op in dict.fromkeys(c["op"] for c in compared):
        mine = [c for c in compared if c["op"] == op]
        variant = "in place" if op in IN_PLACE else "out of place"
        lines += [f"# {op} (nccl-tests {variant})",
                  f"#{'size':>11} {'distlab(us)':>12} {'nccl-tests(us)':>15} {'ratio':>7}"
                  + (f" {'best':>7}" if best else "")]
        lines += [f"{c['size']:>12} {c['seconds'] * 1e6:>12.1f} "
                  f"{c['nccl_tests_seconds'] * 1e6:>15.1f} {c['ratio']:>7.2f}"
                  + (f" {c['best_ratio']:>7.2f}" if best else "") for c in mine]
        worst = max(mine, key=lambda c: c["ratio"])
        lines += [f"# worst: {worst['ratio']:.2f}x at {comm.human_bytes(worst['size'])}", ""]
    return "\n".join(lines).rstrip()


def parse_size(text: str) -> int:
    """'4K', '16M', '1G' or a plain number of bytes (powers of 1024, as nccl-tests)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in units else ""
    return int(float(text[: len(text) - len(unit)]) * units[unit])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    parser.add_argument("-b", "--min-bytes", default="4K", type=parse_size)
    parser.add_argument("-e", "--max-bytes", default="16M", type=parse_size)
    parser.add_argument("-f", "--factor", default=2, type=int, help="size multiplier per step")
    parser.add_argument("-n", "--world-size", type=int,
                        default=int(os.environ.get("WORLD_SIZE", 4)), help="ranks")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "rccl", "gloo"))
    parser.add_argument("--dtype", default="float32", help="torch dtype name")
    parser.add_argument("-w", "--warmup", default=5, type=int)
    parser.add_argument("-i", "--iters", default=20, type=int, help="calls back to back")
    parser.add_argument("-r", "--repeats", default=1, type=int,
                        help="timed runs per size: their median, and the fastest beside it")
    parser.add_argument("--each", default=10, type=int,
                        help="also time this many single calls, each waited for (0: no)")
    parser.add_argument("--graph", action="store_true",
                        help="GPU: time a CUDA graph of the calls (no host cost per call)")
    parser.add_argument("--api", default="torch", choices=APIS,
                        help="torch: torch.distributed's calls, as the labs make them; "
                             "nccl: NCCL's own calls through cupy, as nccl-tests makes them")
    parser.add_argument("--nccl-tests", default=None, metavar="DIR",
                        help="a folder of nccl-tests outputs, <op>_perf.txt: print the "
                             "times side by side")
    parser.add_argument("--out", default="build/bench",
                        help="folder for bench.json and the plots ('' for none)")
    args = parser.parse_args(argv)
    from distlab import backend as backends

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, ...)")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {', '.join(OPS)}")
    if args.api == "nccl" and args.graph:
        parser.error("--graph times torch's calls without their host cost; --api nccl "
                     "already has none of torch's: pick one")
    explained = backends.explain(args.world_size, args.backend)
    print(f"# {explained}; torch {torch.__version__}")
    print(f"# {'NCCL called through cupy' if args.api == 'nccl' else 'torch.distributed calls'}"
          f"; warm-up {args.warmup}, then {args.iters} calls back to back"
          f"{' in a CUDA graph' if args.graph else ''}: time per op, slowest rank"
          + (f"; median of {args.repeats} such runs, min: the fastest" if args.repeats > 1
             else "")
          + (f"; 1 call: median of {args.each} calls each waited for" if args.each else ""))
    if args.world_size == 1:
        print("# one rank: nothing crosses a link; the bandwidths say nothing about the "
              "hardware")
    rows = run(ops, sizes(args.min_bytes, args.max_bytes, args.factor), args.world_size,
               args.backend, dtype, args.warmup, args.iters, each=args.each, graph=args.graph,
               repeats=args.repeats, api=args.api)
    print(table(rows))
    compared = None
    if args.nccl_tests:
        reference = {op: read_nccl_tests(open(os.path.join(args.nccl_tests, f"{op}_perf.txt")).read())
                     for op in ops if os.path.exists(os.path.join(args.nccl_tests, f"{op}_perf.txt"))}
        compared = compare(rows, reference)
        print("\n# against nccl-tests, time per op\n" + comparison_table(compared))
    if args.out:
        import json

        from distlab.viz import bandwidth

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"setup": explained, "torch": torch.__version__, "graph": args.graph,
                       "api": args.api,
                       "repeats": args.repeats,
                       "rows": [dataclasses.asdict(r) for r in rows],
                       "vs_nccl_tests": compared}, f, indent=1)
        bandwidth.plot_busbw(rows, title=explained).savefig(
            os.path.join(args.out, "busbw.png"), dpi=120, bbox_inches="tight")
        bandwidth.plot_times(rows, title=explained).savefig(
            os.path.join(args.out, "time.png"), dpi=120, bbox_inches="tight")
        print(f"# wrote {args.out}/bench.json, busbw.png, time.png")


if __name__ == "__main__":
    main()
