"""Plots of measured bandwidth: busbw and time per call against message size (with the
alpha-beta fit), and the time of a training step against the number of ranks (lab 02)."""
from __future__ import annotations

import matplotlib.pyplot as plt
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
    (``distlab.bench.fits(rows)`` when ``fits`` is None). On log-log axes the latency
    regime is a straight line of slope 1 (busbw grows with the size) and the bandwidth
    regime a plateau."""
    from matplotlib.lines import Line2D

    from distlab import bench

    fits = bench.fits(rows) if fits is None else fits
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    drew_fit = False
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        size = np.array([r.size for r in mine], dtype=float)
        line, = ax.plot(size, [r.busbw / 1e9 for r in mine], "o-", ms=3, label=op)
        if op in fits and mine[0].algbw:
            factor = mine[0].busbw / mine[0].algbw
            grid = np.geomspace(size[0], size[-1], 100)
            ax.plot(grid, grid / fits[op].seconds(grid) * factor / 1e9, "--",
                    color=line.get_color(), lw=1, alpha=0.7)
            drew_fit = True
    sizes = [r.size for r in rows]
    _size_axis(ax, min(sizes), max(sizes))
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title or "bus bandwidth")
    ax.grid(alpha=0.3, which="both" if logy else "major")
    handles, labels = ax.get_legend_handles_labels()
    if drew_fit:
        handles.append(Line2D([], [], color="gray", ls="--", lw=1))
        labels.append("alpha-beta fit")
    ax.legend(handles, labels, fontsize=8)
    return fig


def plot_times(rows, fits=None, title: str = "", ax=None):
    """Time per call (us) against size on log-log axes, one line per op; dashed: the
    alpha-beta fit ``alpha + size / bandwidth`` (flat where latency dominates, slope 1
    where bandwidth does)."""
    from matplotlib.lines import Line2D

    from distlab import bench

    fits = bench.fits(rows) if fits is None else fits
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    drew_fit = False
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        size = np.array([r.size for r in mine], dtype=float)
        line, = ax.plot(size, [r.seconds * 1e6 for r in mine], "o-", ms=3, label=op)
        if op in fits:
            grid = np.geomspace(size[0], size[-1], 100)
            ax.plot(grid, fits[op].seconds(grid) * 1e6, "--", color=line.get_color(), lw=1,
                    alpha=0.7)
            drew_fit = True
    sizes = [r.size for r in rows]
    _size_axis(ax, min(sizes), max(sizes))
    ax.set_yscale("log")
    ax.set_ylabel("time per call (us)")
    ax.set_title(title or "time per call")
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    if drew_fit:
        handles.append(Line2D([], [], color="gray", ls="--", lw=1))
        labels.append("alpha-beta fit")
    ax.legend(handles, labels, fontsize=8)
    return fig


def plot_step_times(workers, series: dict, nbytes: int, title: str = "", ax=None):
    """Time per step (ms) against the number of ranks W, one of which is also the
    server, one line per method (``series``: name -> seconds per rank count)."""
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
