"""Plots of measured bandwidth: busbw and time per op against message size (with the
alpha-beta fit, :mod:`distlab.alphabeta`), and the time of a training step against the
number of ranks (lab 02). matplotlib is imported where a figure is drawn."""
from __future__ import annotations

import numpy as np


def _size_axis(ax, low: float, high: float) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlim(low / 1.3, high * 1.3)
    ticks = [t for t in ax.get_xticks() if low / 1.3 <= t <= high * 1.3]
    ax.set_xticks(ticks)
    ax.set_xticklabels([_label(t) for t in ticks])
    ax.set_xlabel("message size")


def _label(nbytes: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if nbytes < 1024:
            return f"{nbytes:g}{unit}"
        nbytes /= 1024
    return f"{nbytes:g}T"


def plot_busbw(rows, fits=None, title: str = "", ax=None, logy: bool = True):
    """busbw (GB/s) against size, both on log scales (``logy=False`` for a linear
    y-axis), one line per op; dashed: the alpha-beta fit of each op
    (``distlab.alphabeta.fits(rows)`` when ``fits`` is None). On log-log axes the latency
    regime is a straight line of slope 1 (busbw grows with the size) and the bandwidth
    regime a plateau."""
    def fitted(fit, size, first):
        if not first.algbw:  # one rank: busbw is 0 by definition, nothing to fit
            return None
        return size / fit.seconds(size) * (first.busbw / first.algbw) / 1e9

    return _per_op(rows, fits, ax, lambda r: r.busbw / 1e9, fitted, "busbw (GB/s)",
                   title or "bus bandwidth", logy)


def plot_times(rows, fits=None, title: str = "", ax=None):
    """Time per op (us) against size on log-log axes, one line per op; dashed: the
    alpha-beta fit ``alpha + size / bandwidth`` (flat where latency dominates, slope 1
    where bandwidth does); dotted, where measured: one call waited for (``each``), whose
    gap to the line is the cost of launching a call and of waiting for it."""
    return _per_op(rows, fits, ax, lambda r: r.seconds * 1e6,
                   lambda fit, size, first: fit.seconds(size) * 1e6, "time per op (us)",
                   title or "time per op", True,
                   waited=lambda r: None if r.each is None else r.each * 1e6)


def _per_op(rows, fits, ax, value, fitted, ylabel: str, title: str, logy: bool,
            waited=None):
    """One line per op of ``value(row)`` against size, dashed, ``fitted(fit, sizes,
    first row)`` from each op's alpha-beta fit, and dotted ``waited(row)`` where it is
    not None."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from distlab import alphabeta

    fits = alphabeta.fits(rows) if fits is None else fits
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    drew_fit = drew_waited = False
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        size = np.array([r.size for r in mine], dtype=float)
        line, = ax.plot(size, [value(r) for r in mine], "o-", ms=3, label=op)
        grid = np.geomspace(size[0], size[-1], 100)
        curve = fitted(fits[op], grid, mine[0]) if op in fits else None
        if curve is not None:
            ax.plot(grid, curve, "--", color=line.get_color(), lw=1, alpha=0.7)
            drew_fit = True
        points = [(r.size, waited(r)) for r in mine if waited and waited(r) is not None]
        if points:
            ax.plot(*zip(*points), ":", color=line.get_color(), lw=1.2)
            drew_waited = True
    sizes = [r.size for r in rows]
    _size_axis(ax, min(sizes), max(sizes))
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both" if logy else "major")
    handles, labels = ax.get_legend_handles_labels()
    if drew_fit:
        handles.append(Line2D([], [], color="gray", ls="--", lw=1))
        labels.append("alpha-beta fit")
    if drew_waited:
        handles.append(Line2D([], [], color="gray", ls=":", lw=1.2))
        labels.append("1 call, waited for")
    ax.legend(handles, labels, fontsize=8)
    return fig


def plot_step_times(workers, series: dict, nbytes: int, title: str = "", ax=None):
    """Time per step (ms) against the number of ranks W, one of which is also the
    server, one line per method (``series``: name -> seconds per rank count)."""
    import matplotlib.pyplot as plt

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 4))
    for name, seconds in series.items():
        ax.plot(workers, [s * 1e3 for s in seconds], "o-", label=name)
    ax.set_xticks(list(workers))
    ax.set_xlabel("ranks W (one of them also the server)")
    ax.set_ylabel("time per step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"one step on {nbytes / 2**20:.0f} MiB of parameters")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
