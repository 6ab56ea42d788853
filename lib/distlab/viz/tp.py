"""Plots of lab 06 (tensor parallelism): which rank holds which rows and columns of a
block's weights, traffic and compute per rank against the TP size, time per layer on
each kind of link, and the GPU benchmark (:mod:`distlab.bench.tp`)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch


def _owners(n: int, size: int) -> np.ndarray:
    """The rank owning each of ``n`` rows under torch.tensor_split."""
    return np.concatenate([np.full(len(p), r) for r, p in enumerate(np.array_split(np.arange(n), size))])


def plot_shards(d_model: int, n_head: int, size: int, title: str = ""):
    """Which rank holds each row (output feature) or column (input feature) of one
    block's weights, as PyTorch stores them (``weight`` is out × in). The second panel is
    what a plain ``tensor_split`` of the fused qkv rows would give: from 2 ranks on, it
    cuts the q, k, v stack where no rank holds all three of any head."""
    hd, per_rank = d_model // n_head, n_head // size
    by_heads = np.tile((np.arange(d_model) // hd) // per_rank, 3)   # q, k, v rows of each head
    panels = [
        ("attn.qkv, rows grouped\nby heads (column-parallel)", by_heads[:, None], "rows"),
        ("attn.qkv, plain tensor_split\n(wrong: no rank gets\nq, k and v of any head)",
         _owners(3 * d_model, size)[:, None], "rows"),
        ("attn.proj (row-parallel)", (np.arange(d_model) // hd // per_rank)[None, :], "cols"),
        ("mlp.up (column-parallel)", _owners(4 * d_model, size)[:, None], "rows"),
        ("mlp.down (row-parallel)", _owners(4 * d_model, size)[None, :], "cols"),
    ]
    shapes = [(3 * d_model, d_model)] * 2 + [(d_model, d_model), (4 * d_model, d_model),
                                             (d_model, 4 * d_model)]
    colors = ListedColormap(plt.get_cmap("tab10").colors[:size])
    fig, axes = plt.subplots(1, 5, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1, 1, 1, 1, 4]})
    for ax, (name, owner, axis), (rows, cols) in zip(axes, panels, shapes):
        grid = np.broadcast_to(owner, (rows, cols))
        ax.imshow(grid, cmap=colors, vmin=-0.5, vmax=size - 0.5, aspect="auto",
                  interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(f"in features ({cols})", fontsize=8)
        ax.set_ylabel(f"out features ({rows})", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        if "qkv" in name:
            for h in range(1, 3 * n_head):  # the heads, thin
                ax.axhline(h * hd - 0.5, color="w", lw=0.5)
            for k, label in enumerate("qkv"):
                ax.axhline(k * d_model - 0.5, color="k", lw=0.8)
                ax.text(cols * 1.02, (k + 0.5) * d_model, label, va="center", fontsize=9)
    fig.legend(handles=[Patch(color=colors(r), label=f"rank {r}") for r in range(size)],
               loc="lower center", ncol=size, fontsize=9)
    fig.suptitle(title or f"one block over {size} ranks: d_model={d_model}, {n_head} heads",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def plot_traffic(sizes, formula_bytes, measured_bytes, flops_per_rank, title: str = ""):
    """Left: bytes each rank moves per layer against the TP size, the formula and what
    CommLog measured. Right: per rank, that traffic and the layer's FLOPs, each relative
    to its value at 2 ranks: the compute shrinks as 1/t, the traffic does not."""
    sizes = list(sizes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    power = int(np.log2(max(max(formula_bytes), 1)) // 10)       # KiB, MiB, ... on the axis
    unit, name = 1024 ** power, ["bytes", "KiB", "MiB", "GiB", "TiB"][power]
    left.plot(sizes, np.asarray(formula_bytes) / unit, "-", lw=2,
              label="8·b·s·h·(t−1)/t elements × bytes each")
    known = [(t, m / unit) for t, m in zip(sizes, measured_bytes) if m is not None]
    if known:
        left.plot(*zip(*known), "o", ms=8, label="measured (CommLog bus bytes)")
    left.set_xlabel("tensor-parallel size t")
    left.set_ylabel(f"bus {name} per rank and layer")
    left.set_title("traffic per rank and layer (forward + backward)", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    i = sizes.index(2) if 2 in sizes else 0
    right.plot(sizes, np.asarray(formula_bytes) / formula_bytes[i], "o-", label="traffic per rank")
    right.plot(sizes, np.asarray(flops_per_rank) / flops_per_rank[i], "s-", label="FLOPs per rank")
    right.set_xlabel("tensor-parallel size t")
    right.set_ylabel(f"relative to t={sizes[i]}")
    right.set_title(f"per rank: FLOPs fall as 1/t, traffic rises\n(toward {sizes[i] / (sizes[i] - 1):.3g}x "
                    f"its t={sizes[i]} value, as (t−1)/t → 1)", fontsize=10)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_layer_times(rows, title: str = ""):
    """Time per layer and step of each model: its compute per rank beside its TP
    traffic on each link. ``rows``: dicts with model, what (a label), ms."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        y = np.arange(len(mine))
        colors = ["tab:green" if r["what"].startswith("compute") else "tab:blue" for r in mine]
        ax.barh(y, [r["ms"] for r in mine], color=colors)
        for k, r in enumerate(mine):
            ax.text(r["ms"] * 1.1, k, f"{r['ms']:.3g} ms", va="center", fontsize=8)
        ax.set_yticks(y, [r["what"] for r in mine], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(right=max(r["ms"] for r in mine) * 8)
        ax.set_xlabel("ms per layer (forward + backward)")
        ax.set_title(model, fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_bench(results: dict, title: str = ""):
    """Time per step of each variant on each link (``results``: link -> variant ->
    figures with ``step_s``), log scale; links and variants that failed (``error``) are
    left out."""
    links = [link for link, rows in results.items() if "error" not in rows]

    def measured(link, name):
        return "step_s" in results[link].get(name, {})

    variants = [v for v in dict.fromkeys(v for link in links for v in results[link])
                if any(measured(link, v) for link in links)]
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(links) + 2), 4))
    for i, name in enumerate(variants):
        ms = [1e3 * results[link][name]["step_s"] if measured(link, name) else np.nan
              for link in links]
        x = np.arange(len(links)) + (i - (len(variants) - 1) / 2) * width
        bars = ax.bar(x, ms, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(np.arange(len(links)), links)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step")
    ax.set_title(title or "time per step", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    if variants:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
