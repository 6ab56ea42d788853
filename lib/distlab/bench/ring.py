"""The ring all-reduce against the backend's own, measured in the same run.

    python -m distlab.bench.ring                       # 4 gloo ranks, 64 KiB .. 64 MiB
    python -m distlab.bench.ring --op reduce_scatter   # ring vs the backend's reduce-scatter
    python -m distlab.bench.ring --backend nccl --world-size 2 -b 64M -e 1G -f 2
    python -m distlab.bench.ring ... --pieces 128M,1G  # the reference with other piece sizes
    python -m distlab.bench.ring --backend nccl -n 2 -b 64M -e 1G --graph  # the GPU's time alone

Three contenders per size: the backend's collective,
:func:`~distlab.collectives.ring.plain_ring_allreduce` (the straightforward ring: a fresh
buffer per step, ``+=``, a copy back at the end) and the reference
:func:`~distlab.collectives.ring.ring_allreduce` (receives in place, no needless copies,
pieces pipelined where the chunks are large for the backend); both are lab 03's answers.
They run interleaved, round after round, so that a machine whose speed drifts (a busy
laptop, a shared CI box) slows all of them alike; in each round a contender's time per call
is that of a few calls back to back (:func:`distlab.bench.collectives.time_op`), every
contender untraced (:func:`distlab.comm.quiet`: a ring of many traced calls would otherwise
pay bookkeeping that the backend's one call does not). Each ratio is ``time(backend) /
time(contender)`` in the same round, i.e. the contender's busbw over the backend's; the
table gives its median over the rounds and its range (min-max), which says how much of a
difference is noise. busbw follows nccl-tests (:func:`distlab.comm.bus_factor`). Beside each
time per call stands the host's time to issue one call: a ring issued from Python pays for
every exchange on the host, and where that nears the GPU's time per call the host, not the
link, sets the pace. ``--graph`` (GPUs) captures each contender's calls, the backend's too,
in a CUDA graph and times its replay: the GPU's work alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics

import torch
import torch.distributed as dist

from distlab import backend as backends
from distlab import launch
from distlab.collectives import ring, ring_layout
from distlab import comm
from distlab.bench.collectives import parse_size, sizes
from distlab.bench.timing import host_seconds, time_op
from distlab.comm import bus_factor
from distlab.units import size_label

OPS = ("all_reduce", "reduce_scatter")
DEFAULT_SIZES = tuple(1 << k for k in range(16, 27, 2))  # 64 KiB .. 64 MiB


def _backend_reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    K = dist.get_world_size(group)
    if x.numel() % K:
        raise ValueError(f"the backend's reduce_scatter_tensor needs a size divisible by "
                         f"{K}, got {x.numel()} elements")
    out = torch.empty(x.numel() // K, dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, x, group=group)
    return out


def allreduce_then_chunk(x: torch.Tensor, group=None) -> torch.Tensor:
    """A reduce-scatter made of a whole all-reduce: what gloo does inside its own."""
    dist.all_reduce(x, group=group)
    return torch.tensor_split(x, dist.get_world_size(group))[dist.get_rank(group)]


BACKEND = {"all_reduce": dist.all_reduce, "reduce_scatter": _backend_reduce_scatter}
CONTENDERS = {
    "all_reduce": {"plain ring": ring.plain_ring_allreduce, "reference ring": ring.ring_allreduce},
    "reduce_scatter": {"reference ring": ring.ring_reduce_scatter,
                       "all_reduce, keep a chunk": allreduce_then_chunk},
}


@dataclasses.dataclass
class Result:
    """Median seconds per size of each contender, and its busbw relative to the backend."""

    op: str
    world_size: int
    backend: str
    dtype: str
    sizes: list[int]                   # message bytes, as nccl-tests counts them
    seconds: dict[str, list[float]]    # name -> median seconds, per size ("backend" too)
    ratio: dict[str, list[float]]      # name -> median over rounds of t(backend) / t(name)
    spread: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    # name -> [lowest, highest] of t(backend) / t(name) over the rounds, per size
    rounds: int = 0
    host: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # name -> the host's seconds to issue one call (median, slowest rank), per size
    graph: bool = False                # timed as CUDA graph replays (no host cost per call)

    def busbw(self, name: str) -> list[float]:
        """Bytes per second, nccl-tests' bus bandwidth."""
        f = bus_factor(self.op, self.world_size)
        return [size * f / t for size, t in zip(self.sizes, self.seconds[name])]

    def table(self) -> str:
        """busbw in GB/s of every contender, then each one's busbw over the backend's,
        median and range over the rounds. Long names wrap over header lines."""
        import textwrap

        names = list(self.seconds)
        others = [n for n in names if n != "backend"]
        rows = [[f"{self.busbw(n)[i] / 1e9:.3f}" for n in names]
                + [f"{self.ratio[n][i]:.2f}x" + (" ({:.2f}-{:.2f})".format(*self.spread[n][i])
                                                 if n in self.spread else "") for n in others]
                for i in range(len(self.sizes))]
        heads = [textwrap.wrap(n, 14) or [""] for n in names + others]
        depth = max(len(h) for h in heads)
        heads = [[""] * (depth - len(h)) + h for h in heads]  # names end on the same line
        widths = [max(8, *(len(line) for line in h), *(len(r[c]) for r in rows))
                  for c, h in enumerate(heads)]
        left = len(names)

        def row(first, cells):
            return (f"{first:>9}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells[:left], widths))
                    + "  |  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells[left:], widths[left:])))

        lines = [f"{self.op}, {self.world_size} {self.backend} ranks, {self.dtype}"
                 f"{', CUDA graphs' if self.graph else ''}: busbw in GB/s  |  busbw / "
                 f"backend's, median (min-max) of {self.rounds} rounds",
                 *(row("size" if d == depth - 1 else "", [h[d] for h in heads])
                   for d in range(depth))]
        lines += [row(size_label(size), cells) for size, cells in zip(self.sizes, rows)]
        if self.host and not self.graph:
            lines += ["host's time to issue one call, us (where it nears the time per call, "
                      "the host sets the pace)",
                      *(f"{size_label(size):>9}  " + "  ".join(
                          f"{n}: {self.host[n][i] * 1e6:.0f} of {self.seconds[n][i] * 1e6:.0f}"
                          for n in names) for i, size in enumerate(self.sizes))]
        return "\n".join(lines)


def measure(op: str = "all_reduce", sizes=DEFAULT_SIZES, world_size: int = 4,
            backend: str = "gloo", rounds: int | None = None, dtype: str = "float32",
            contenders: dict | None = None, timeout: float = 600,
            iters: int | None = None, graph: bool = False) -> Result:
    """Time the backend's ``op`` and each contender (name -> ``fn(tensor)``, run on every
    rank; default: :data:`CONTENDERS`) at each size, interleaved over ``rounds`` rounds
    (default: 15 on NCCL, where a round is short, 7 elsewhere), each a run of ``iters``
    calls back to back (default: 10 on NCCL, 1 elsewhere), all untraced; and the host's
    time to issue one call of each (where it nears the time per call, Python's cost
    of issuing the ring, not the ring's transfers, sets the pace). ``graph`` (GPUs):
    each run is a CUDA graph of the ``iters`` calls, replayed, which times what the GPU
    does alone, the backend's call included.

    Every contender's answer is first checked against the backend's: a wrong answer
    has no speed. Functions defined in a notebook can be contenders."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    contenders = CONTENDERS[op] if contenders is None else contenders
    name = backends.choose(world_size, backend)
    rounds = rounds or (15 if name == "nccl" else 7)
    iters = iters or (10 if name == "nccl" else 1)
    if graph and name not in ("nccl", "rccl"):
        raise ValueError(f"graph=True replays CUDA graphs: it needs GPUs and nccl, not {name}")
    runs = launch.run(_measure_rank, world_size, op, list(sizes), rounds, dtype, contenders,
                      iters, graph, backend=name, timeout=timeout)
    measured, seconds, ratio, spread, host = runs[0]
    return Result(op, world_size, name, dtype, measured, seconds, ratio, spread, rounds, host,
                  graph)


def ring_with_pieces(piece_bytes: int, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The reference ring all-reduce with pieces of at most ``piece_bytes``."""
    saved, ring_layout.PIECE_BYTES = ring_layout.PIECE_BYTES, piece_bytes
    try:
        return ring.ring_allreduce(tensor, group)
    finally:
        ring_layout.PIECE_BYTES = saved


def _measure_rank(op, sizes, rounds, dtype, contenders, iters, graph):
    K, device = dist.get_world_size(), backends.device()
    dt = getattr(torch, dtype)
    fns = {"backend": BACKEND[op], **contenders}
    seconds = {n: [] for n in fns}
    ratio = {n: [] for n in fns if n != "backend"}
    spread = {n: [] for n in ratio}
    host = {n: [] for n in fns}
    measured = []
    for size in launch.progress(sizes, desc=f"{op} sizes"):
        numel = size // dt.itemsize
        numel -= numel % K  # the backend's reduce_scatter_tensor wants equal chunks
        measured.append(numel * dt.itemsize)
        _check(op, fns, numel, dt, device)
        x = torch.zeros(numel, dtype=dt, device=device)  # zeros: sums stay finite
        times = {n: [] for n in fns}
        for k in range(rounds + 1):
            order = list(fns)[k % len(fns):] + list(fns)[: k % len(fns)]
            for n in order:
                with comm.quiet():
                    t = time_op(lambda: fns[n](x), warmup=0, iters=iters, graph=graph)
                if k:  # round 0 is the warm-up
                    times[n].append(t)
        for n in fns:
            seconds[n].append(statistics.median(times[n]))
            with comm.quiet():
                host[n].append(host_seconds(functools.partial(fns[n], x)))
        for n in ratio:
            per_round = [b / t for b, t in zip(times["backend"], times[n])]
            ratio[n].append(statistics.median(per_round))
            spread[n].append([min(per_round), max(per_round)])
    return measured, seconds, ratio, spread, host


# Odd lengths from 1 element to 1 GiB of float32 (1 B, 3 B, ... in uint8), for --check.
CHECK_CASES = ([(n, "uint8") for n in (1, 3, 1025)] +
               [(n, "float32") for n in (1, 2, 3, 7, 4097, (1 << 20) + 3, (16 << 20) + 1,
                                          (64 << 20) - 1, (256 << 20) + 3)] +
               [((32 << 20) + 5, "bfloat16")])


def check(world_size: int = 2, backend: str = "auto", cases=CHECK_CASES,
          timeout: float = 600) -> list[str]:
    """The reference ring all-reduce against the backend's, on ``cases`` (numel, dtype
    name); the failures, in words (empty when every answer is exact)."""
    return launch.run(_check_rank, world_size, list(cases), backend=backends.choose(
        world_size, backend), timeout=timeout)[0]


def _check_rank(cases):
    fns = {"backend": BACKEND["all_reduce"], "reference ring": ring.ring_allreduce}
    failures = []
    for numel, dtype in launch.progress(cases, desc="ring all_reduce sizes"):
        try:
            _check("all_reduce", fns, numel, getattr(torch, dtype), backends.device())
        except AssertionError as exc:
            failures.append(str(exc))
    return failures


def _check(op, fns, numel, dt, device):
    """Every contender's answer equals the backend's (integers in floats: exact sums)."""
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randint(-8, 8, (numel,), generator=g, device=device).to(dt)
    answers = {}
    for n, fn in fns.items():
        y = x.clone()
        out = fn(y)
        answers[n] = y if op == "all_reduce" else out
    for n, got in answers.items():
        if not torch.equal(got, answers["backend"]):
            raise AssertionError(f"{n} gives a wrong {op} of {numel} {str(dt)[6:]} elements; "
                                 f"fix it before timing it")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.bench.ring", description=__doc__.split("\n")[0])
    p.add_argument("--op", choices=OPS, default="all_reduce")
    p.add_argument("-n", "--world-size", type=int, default=4)
    p.add_argument("--backend", default="gloo", choices=("auto", "gloo", "nccl", "rccl"))
    p.add_argument("-b", "--min-bytes", type=parse_size, default=DEFAULT_SIZES[0])
    p.add_argument("-e", "--max-bytes", type=parse_size, default=DEFAULT_SIZES[-1])
    p.add_argument("-f", "--factor", type=int, default=4, help="size multiplier per step")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every contender (default: 15 on NCCL, else 7)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls back to back per round (default: 10 on NCCL, else 1)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--graph", action="store_true", help="GPUs: time CUDA graphs of the calls, "
                   "so that the host's cost of issuing them is out of every contender")
    p.add_argument("--pieces", default="", help="all_reduce: also the reference ring with "
                   "pieces of at most these sizes, e.g. 128M,1G (1G: whole chunks up to 2 GiB)")
    p.add_argument("--out", default="build/ring_bench", help="folder for the figure and "
                   "ring_bench.json ('' for none)")
    p.add_argument("--check", action="store_true", help="only check the reference ring "
                   "all-reduce against the backend's, 1 B to 1 GiB, odd lengths")
    a = p.parse_args(argv)
    from distlab.bench import ring as ring_bench  # not __main__: the ranks import it rather than unpickle it

    if a.check:
        failures = ring_bench.check(a.world_size, a.backend)
        print("\n".join(failures) or f"the ring all-reduce equals the backend's on "
              f"{a.world_size} ranks: {', '.join(f'{n} x {d}' for n, d in CHECK_CASES)}")
        return 1 if failures else 0

    contenders = dict(CONTENDERS[a.op])
    for text in filter(None, a.pieces.split(",")):
        if a.op != "all_reduce":
            p.error("--pieces compares piece sizes of the ring all-reduce (--op all_reduce)")
        contenders[f"reference ring, {size_label(parse_size(text))} pieces"] = \
            functools.partial(ring_bench.ring_with_pieces, parse_size(text))
    result = ring_bench.measure(a.op, sizes(a.min_bytes, a.max_bytes, a.factor), a.world_size,
                                a.backend, a.rounds, a.dtype, contenders, iters=a.iters,
                                graph=a.graph)
    print(result.table())
    if a.out:
        import json
        import os

        from distlab.viz.ring import plot_bench

        os.makedirs(a.out, exist_ok=True)
        plot_bench(result).savefig(os.path.join(a.out, "ring_bench.png"), dpi=120,
                                   bbox_inches="tight")
        with open(os.path.join(a.out, "ring_bench.json"), "w") as f:
            json.dump(dataclasses.asdict(result), f, indent=1)
        print(f"wrote {a.out}/ring_bench.png, ring_bench.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
