"""Plots of training runs: the loss against the language's floor, and our
DataParallel against torch's DistributedDataParallel (lab 04)."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np


def smooth(values, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what there is so far)."""
    v = np.asarray(values, dtype=float)
    csum = np.cumsum(np.insert(v, 0, 0.0))
    n = np.arange(1, len(v) + 1)
    lo = np.maximum(n - window, 0)
    return (csum[n] - csum[lo]) / (n - lo)


def plot_loss(losses, floor: float, vocab_size: int | None = None, window: int = 20,
              title: str = "", ax=None, levels: dict | None = None,
              floor_label: str = "window floor"):
    """Training loss (nats/token) per step, raw and smoothed over ``window`` steps,
    with the exact floor of the training window (the best mean loss any model can reach
    over it, labelled ``floor_label``), other reference ``levels`` (label -> nats/token,
    e.g. the best loss from the previous token alone) and, given ``vocab_size``, the
    loss ln(V) of a uniform guess."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    steps = np.arange(len(losses))
    line, = ax.plot(steps, smooth(losses, window), lw=2, label=f"training loss ({window}-step mean)")
    ax.plot(steps, losses, color=line.get_color(), lw=0.6, alpha=0.3)
    ax.axhline(floor, color="k", ls="--", lw=1.2, label=f"{floor_label} {floor:.3f}")
    for (label, value), color in zip((levels or {}).items(), ("tab:orange", "tab:green",
                                                              "tab:purple", "tab:brown")):
        ax.axhline(value, color=color, ls="-.", lw=1, label=f"{label} {value:.3f}")
    if vocab_size:
        ax.axhline(math.log(vocab_size), color="grey", ls=":", lw=1,
                   label=f"uniform guess ln {vocab_size} = {math.log(vocab_size):.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "loss against the best reachable loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_dp_vs_ddp(losses: dict, step_ms: dict, title: str = "", reference: str | None = None):
    """Left: the loss per step of each implementation (``losses``: name -> list), and the
    largest difference of any of them from ``reference`` (a key of ``losses``; default:
    the last). Right: time per step (``step_ms``: name -> {world_size: milliseconds}),
    grouped by world size."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(losses)
    for i, name in enumerate(names):
        left.plot(losses[name], lw=2.5 if i == 0 else 1.2, ls="-" if i == 0 else "--", label=name)
    if len(names) >= 2:
        reference = names[-1] if reference is None else reference
        ref = np.asarray(losses[reference])
        gap = max(np.max(np.abs(np.asarray(losses[n]) - ref)) for n in names if n != reference)
        left.set_title(f"loss per step (largest difference from {reference}: {gap:.1e})",
                       fontsize=10)
    left.set_xlabel("step")
    left.set_ylabel("loss (nats/token)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    worlds = sorted({w for series in step_ms.values() for w in series})
    width = 0.8 / len(step_ms)
    for i, (name, series) in enumerate(step_ms.items()):
        x = np.arange(len(worlds)) + (i - (len(step_ms) - 1) / 2) * width
        bars = right.bar(x, [series.get(w, np.nan) for w in worlds], width, label=name)
        right.bar_label(bars, fmt="%.1f", fontsize=7)
    right.set_xticks(np.arange(len(worlds)), [str(w) for w in worlds])
    right.set_xlabel("ranks")
    right.set_ylabel("time per step (ms)")
    right.set_title("time per step")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
