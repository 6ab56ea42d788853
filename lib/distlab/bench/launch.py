"""What a launch costs: cold (fresh Python), new ranks (fork server warm), warm ranks.

    python -m distlab.bench.launch [--world-size 4] [--repeat 10]

*cold*: the first ``launch.run`` of a fresh interpreter — starting the fork server
(which imports torch once), forking the ranks, the rendezvous, the call and the
answer. *new ranks*: a launch that needs new ranks while the fork server is warm (a new
world size, or the launch after a failure). *warm*: the same world size and backend as
the previous launch, on the ranks kept from it.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_COLD = """
import sys, time
import torch.distributed as dist
from distlab import launch
start = time.perf_counter()
launch.run(dist.get_rank, {n}, backend="gloo")
print(time.perf_counter() - start)
"""


def _noop():
    return None


def cold(world_size: int) -> float:
    """Seconds of the first launch in a fresh interpreter (its own imports excluded)."""
    out = subprocess.run([sys.executable, "-c", _COLD.format(n=world_size)],
                         capture_output=True, text=True, check=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def new_ranks(world_size: int, repeat: int) -> list[float]:
    from distlab import launch

    times = []
    for _ in range(repeat):
        launch.shutdown()
        start = time.perf_counter()
        launch.run(_noop, world_size, backend="gloo")
        times.append(time.perf_counter() - start)
    return times


def warm(world_size: int, repeat: int) -> list[float]:
    from distlab import launch

    launch.run(_noop, world_size, backend="gloo")
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        launch.run(_noop, world_size, backend="gloo")
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    n = args.world_size
    colds = [cold(n) for _ in range(3)]
    warm(n, 1)  # start this process's fork server before timing the others
    rows = [("cold (fresh Python)", colds), ("new ranks (fork server warm)",
                                              new_ranks(n, args.repeat)),
            ("warm ranks", warm(n, args.repeat))]
    print(f"launch of {n} gloo ranks, median (min-max) over the runs:")
    for name, times in rows:
        print(f"  {name:<30} {1000 * statistics.median(times):8.1f} ms"
              f"   ({1000 * min(times):.1f}-{1000 * max(times):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
