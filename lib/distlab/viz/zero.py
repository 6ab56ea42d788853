"""ZeRO, drawn (lab 05): bytes per rank and stage, the traffic of each strategy, which
elements a sharded kernel updates, and a memory calculator.

:class:`MemoryCalculator` takes any parameter count Ψ and number of GPUs N and shows the
paper's bytes per GPU for data parallelism and the three stages, against a GPU's memory,
from a ``zero_bytes(num_params, world_size, stage)`` at K = 12 (default: the library's;
lab 05 passes its ``zero_bytes_per_rank``).
Without a widget front end (GitHub, a static HTML export) it shows the same as a table
and a picture. The plots take plain numbers (dicts of bytes), never the objects that
made them. matplotlib and ipywidgets are imported where they are used, so that the
lab's exercise module (which takes the notebook's imports) needs neither.
"""
from __future__ import annotations

import textwrap

import numpy as np

from distlab.units import decimal_bytes
from distlab.zero.memory import STAGE_NAMES, STAGES, zero_bytes
from distlab.viz import png

CATEGORIES = ("params", "grads", "master", "optimizer")
LABELS = {"params": "weights", "grads": "gradients", "master": "fp32 master weights",
          "optimizer": "AdamW moments"}
COLORS = {"params": "tab:blue", "grads": "tab:orange", "master": "tab:green",
          "optimizer": "tab:purple"}
GPUS = {"H200 (141 GB)": 141e9, "H100 (80 GB)": 80e9, "A100 (40 GB)": 40e9,
        "RTX 4090 (24 GB)": 24e9}


def _done(fig):
    """Lay the figure out and close it (a notebook shows the returned figure once)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_rank_bytes(held: dict[str, list[dict]], formula: dict[str, float] | None = None,
                    title: str = "", scale: float = 1e3, unit: str = "kB",
                    formula_label: str = "the paper's formula"):
    """Stacked bars of the bytes each rank holds, grouped by strategy: ``held`` maps a
    strategy to one dict per rank (keys of :data:`CATEGORIES`; a category no rank holds
    is left out of the key); ``formula`` (optional) maps a strategy to a predicted
    bytes-per-rank, drawn as a black line over its bars and keyed ``formula_label``."""
    import matplotlib.pyplot as plt

    names = list(held)
    shown = [c for c in CATEGORIES if any(r.get(c, 0) for ranks in held.values() for r in ranks)]
    width = 0.8 / max(len(ranks) for ranks in held.values())
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(names)), 4.2))
    for g, name in enumerate(names):
        ranks = held[name]
        for r, rank_bytes in enumerate(ranks):
            x = g + (r - (len(ranks) - 1) / 2) * width
            bottom = 0.0
            for cat in shown:
                value = rank_bytes.get(cat, 0) / scale
                ax.bar(x, value, width * 0.9, bottom=bottom, color=COLORS[cat],
                       label=LABELS[cat] if (g, r) == (0, 0) else None)
                bottom += value
            ax.text(x, bottom, f"r{r}", ha="center", va="bottom", fontsize=7)
        if formula and name in formula:
            half = len(ranks) * width / 2
            ax.hlines(formula[name] / scale, g - half, g + half, color="k", lw=1.5,
                      label=formula_label if g == 0 else None)
    ax.set_xticks(range(len(names)), [textwrap.fill(n, 16, break_long_words=False) for n in names], fontsize=9)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_title(title or "what each rank holds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right")
    return _done(fig)


def plot_equivalence(gaps: dict[tuple[int, str], float], title: str = ""):
    """The largest difference from one process (losses and weights) of each strategy
    (groups) at each world size (bars), on a log scale, against float64's rounding."""
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s for _, s in gaps))
    worlds = sorted({w for w, _ in gaps})
    width = 0.8 / len(worlds)
    fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(names)), 3.8))
    for i, w in enumerate(worlds):
        xs = [g + (i - (len(worlds) - 1) / 2) * width for g, s in enumerate(names)
              if (w, s) in gaps]
        ys = [max(gaps[w, s], 1e-18) for s in names if (w, s) in gaps]
        ax.bar(xs, ys, width * 0.9, label=f"{w} rank{'s' if w > 1 else ''}",
               color=plt.cm.viridis(i / max(len(worlds) - 1, 1)))
    ax.axhline(np.finfo(np.float64).eps, color="k", ls="--", lw=1,
               label="float64 epsilon (2.2e-16)")
    ax.set_yscale("log")
    ax.set_ylim(1e-18, 1e-8)
    ax.set_xticks(range(len(names)), [textwrap.fill(n, 16, break_long_words=False) for n in names], fontsize=9)
    ax.set_ylabel("largest |difference| from one process")
    ax.set_title(title or "losses and weights against one process", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3, axis="y")
    return _done(fig)


def plot_traffic(volumes: dict[str, float], title: str = ""):
    """Horizontal bars: each strategy's bytes per rank and step on the wire (``volumes``,
    in units of Ψ), with the 2Ψ of data parallelism marked (keyed beside the axes, where
    the key covers no bar)."""
    import matplotlib.pyplot as plt

    names = list(volumes)
    fig, ax = plt.subplots(figsize=(8.2, 0.45 * len(names) + 1.2))
    bars = ax.barh(range(len(names)), [volumes[n] for n in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.2fΨ", fontsize=8, padding=3)
    ax.axvline(2.0, color="k", ls="--", lw=1, label="data parallelism:\n2Ψ")
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(volumes.values()) * 1.2)
    ax.set_xlabel("bytes per rank and step on the wire, in units of Ψ (the gradients' bytes)")
    ax.set_title(title or "traffic per step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return _done(fig)


def plot_coverage(rows: dict[str, np.ndarray], title: str = ""):
    """One row per kernel (``rows``: name -> how many ranks update each element): white
    where no rank updates an element, green once, red more than once."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    names = list(rows)
    counts = np.stack([np.minimum(rows[n], 2) for n in names])
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.2))
    ax.imshow(counts, aspect="auto", interpolation="nearest", vmin=0, vmax=2,
              cmap=ListedColormap(["white", "tab:green", "tab:red"]))
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.set_xlabel("element of the flat buffer")
    for i, name in enumerate(names):
        lost, twice = int((rows[name] == 0).sum()), int((rows[name] > 1).sum())
        ax.text(counts.shape[1] - 0.5, i, f"  never: {lost}, twice or more: {twice}",
                va="center", ha="left", fontsize=8)
    ax.set_title(title or "which elements the kernels update (green: once; red: twice or "
                          "more; white: never)", fontsize=10)
    return _done(fig)


def calculator_table(num_params: float, world_size: int, k: float = 12,
                     zero_bytes=zero_bytes) -> list[tuple]:
    """(stage, formula, bytes per GPU) of data parallelism and the three stages:
    ``zero_bytes(num_params, world_size, stage)``'s bytes at K = 12, with the optimizer
    state's K bytes per parameter moved to ``k`` (whole from stage 1 on: sharded)."""
    formulas = {0: "(4+K)Ψ", 1: "4Ψ + KΨ/N", 2: "2Ψ + (2+K)Ψ/N", 3: "(4+K)Ψ/N"}
    return [(STAGE_NAMES[s], formulas[s], zero_bytes(num_params, world_size, s)
             + (k - 12) * num_params / (1 if s == 0 else world_size)) for s in STAGES]


def _log_bytes_axis(ax, low: float, high: float) -> None:
    """A log y axis from ``low`` to ``high`` bytes, its labelled ticks in decimal units
    (1 GB, 2 GB, 5 GB... within two decades, powers of ten beyond), minor ticks
    unlabelled (no 6×10¹ between them)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.set_ylim(low, high)
    subs = (1.0, 2.0, 5.0) if np.log10(high / low) <= 2 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: decimal_bytes(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def calculator_figure(num_params: float, world_size: int, gpu_bytes: float | None = None,
                      k: float = 12, zero_bytes=zero_bytes):
    """Bars of :func:`calculator_table` on a log scale, each one's bytes under its name,
    and one GPU's memory as a dashed line keyed beside the axes (the labels stay clear
    of the line and of the frame whatever the numbers)."""
    import matplotlib.pyplot as plt

    table = calculator_table(num_params, world_size, k, zero_bytes)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    values = [b for _, _, b in table]
    ax.bar(range(len(table)), values, color=["tab:gray", "tab:blue", "tab:orange", "tab:green"])
    ax.set_xticks(range(len(table)), [f"{name}\n{decimal_bytes(b)}" for name, _, b in table])
    shown = values + ([gpu_bytes] if gpu_bytes else [])
    _log_bytes_axis(ax, max(min(shown), 1.0) / 2, max(max(shown), 1.0) * 1.6)
    if gpu_bytes:
        ax.axhline(gpu_bytes, color="crimson", ls="--", lw=1,
                   label=f"one GPU:\n{decimal_bytes(gpu_bytes)}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_ylabel("bytes per GPU (log scale)")
    ax.set_title(f"Ψ = {num_params:,.0f} parameters on N = {world_size} GPUs, K = {k:g}",
                 fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return _done(fig)


class MemoryCalculator:
    """Bytes per GPU of data parallelism and ZeRO stages 1-3 for any Ψ and N (the
    paper's formulas, mixed-precision Adam, from ``zero_bytes``: see
    :func:`calculator_table`), against a chosen GPU's memory. Displayed, it is its
    ipywidgets box (``.widget``); as a static output, a table and a picture."""

    def __init__(self, num_params: float = 7.5e9, world_size: int = 64,
                 gpu: str = "H200 (141 GB)", zero_bytes=zero_bytes):
        import ipywidgets as widgets

        self.zero_bytes = zero_bytes

        self.psi = widgets.FloatText(value=num_params, description="parameters Ψ",
                                     style={"description_width": "initial"})
        self.n = widgets.BoundedIntText(value=world_size, min=1, max=1 << 20,
                                        description="GPUs N")
        self.gpu = widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU")
        self.k = widgets.BoundedFloatText(value=12, min=0, max=64, step=1,
                                          description="K (bytes)")
        self.table = widgets.HTML()
        self.image = widgets.Image(format="png")
        for w in (self.psi, self.n, self.gpu, self.k):
            w.observe(lambda _: self.update(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.psi, self.n]),
                                    widgets.HBox([self.gpu, self.k]), self.table, self.image],
                                   layout=widgets.Layout(align_items="flex-start"))
        self.update()

    def _values(self):
        return max(float(self.psi.value), 0.0), int(self.n.value), float(self.k.value)

    def update(self) -> None:
        psi, n, k = self._values()
        limit = GPUS[self.gpu.value]
        left, right = " style='text-align:left'", " style='text-align:right'"
        rows = "".join(
            f"<tr><td>{name}</td><td>{formula}</td><td{right}>{b / 1e9:,.1f} GB</td>"
            f"<td>{'fits' if b <= limit else 'does not fit'}</td></tr>"
            for name, formula, b in calculator_table(psi, n, k, self.zero_bytes))
        self.table.value = (f"<table style='border-spacing: 1.2em 0.2em'><tr>"
                            f"<th{left}>strategy</th><th{left}>formula</th>"
                            f"<th{right}>bytes per GPU</th><th{left}>in one {self.gpu.value}</th>"
                            f"</tr>{rows}</table>")
        self.image.value = png(calculator_figure(psi, n, limit, k, self.zero_bytes))

    def __repr__(self) -> str:
        psi, n, k = self._values()
        lines = [f"ZeRO memory per GPU, Ψ = {psi:,.0f}, N = {n}, K = {k:g}:"]
        lines += [f"  {name:<14} {formula:<16} {b / 1e9:>10,.1f} GB"
                  for name, formula, b in calculator_table(psi, n, k, self.zero_bytes)]
        return "\n".join(lines)

    def _repr_mimebundle_(self, **kwargs):
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        psi, n, k = self._values()
        data["text/plain"] = repr(self)
        data["image/png"] = png(calculator_figure(psi, n, GPUS[self.gpu.value], k,
                                                  self.zero_bytes))
        return data


def plot_gpu_figures(results: list[dict]):
    """The figures of ``python -m distlab.bench.zero`` (one dict per rank): the kernel's
    bandwidth; per rank and strategy, model states, activations and the optimizer step's
    buffers against the accounting, and the peak; ZeRO-3 against FSDP2 with each
    AdamW."""
    import matplotlib.pyplot as plt

    fig, (k_ax, m_ax, s_ax) = plt.subplots(1, 3, figsize=(16, 4.6),
                                           gridspec_kw={"width_ratios": [1, 2, 1.3]})
    kernel = results[0].get("kernel", {})
    if "tb_per_s" in kernel:
        names = list(kernel["tb_per_s"])
        bars = k_ax.bar(names, [kernel["tb_per_s"][n] for n in names],
                        color=["tab:green", "tab:blue", "tab:gray"])
        k_ax.bar_label(bars, fmt="%.2f", fontsize=8)
        k_ax.set_ylabel("TB/s at 28 bytes per parameter")
        k_ax.set_title(f"AdamW on a shard of {kernel['shard']:,}", fontsize=10)
    else:
        k_ax.text(0.5, 0.5, "kernel: not measured\n(needs CUDA and cupy)", ha="center",
                  va="center", transform=k_ax.transAxes)
    memory = [r.get("memory", {}) for r in results]
    if memory and "activations" in memory[0]:
        big = memory[0]["data parallel"]["accounting"]["total"] > 1e7
        scale, unit = (1e9, "GB") if big else (1e3, "kB")
        strategies = [s for s in memory[0] if isinstance(memory[0][s], dict)]
        width = 0.8 / len(memory)
        for g, strategy in enumerate(strategies):
            for rank, m in enumerate(memory):
                s = m[strategy]
                x = g + (rank - (len(memory) - 1) / 2) * width
                first = g + rank == 0
                m_ax.bar(x, s["states"] / scale, width * 0.9, color="tab:blue",
                         label="model states, end of backward" if first else None)
                m_ax.bar(x, memory[0]["activations"] / scale, width * 0.9,
                         bottom=s["states"] / scale, color="tab:gray", alpha=0.5,
                         label="activations (measured apart)" if first else None)
                m_ax.hlines((s["states"] + s["step buffers"]) / scale, x - width / 2,
                            x + width / 2, color="tab:green", lw=2, linestyles="dashed",
                            label="states + optimizer step buffers" if first else None)
                m_ax.hlines(s["accounting"]["total"] / scale, x - width / 2, x + width / 2,
                            color="k", lw=2, label="distlab.zero.memory.accounting" if first else None)
                m_ax.plot(x, s["peak"] / scale, "v", color="tab:red", ms=6,
                          label="peak (above the baseline)" if first else None)
        m_ax.set_xticks(range(len(strategies)), strategies)
        m_ax.set_ylim(0, 1.4 * max(m[s]["peak"] for m in memory for s in strategies) / scale)
        m_ax.set_ylabel(f"{unit} per rank")
        m_ax.set_title(f"bf16 + fp32 AdamW, {len(memory)} ranks: what each rank holds",
                       fontsize=10)
        m_ax.legend(fontsize=7, ncol=2, loc="upper center")
    speed = results[0].get("speed", {})
    if any("step" in r for runs in speed.get("runs", {}).values() for r in runs.values()):
        labels, steps, optims = [], [], []
        for opt_name, runs in speed["runs"].items():
            for name, r in runs.items():
                if "error" in r:
                    continue
                labels.append(f"{name}\nAdamW {opt_name}")
                steps.append(1e3 * r["step"])
                optims.append(1e3 * r["optimizer"])
        colors = ["tab:green" if lab.startswith("ZeRO") else "tab:gray" for lab in labels]
        bars = s_ax.bar(range(len(labels)), steps, color=colors)
        s_ax.bar(range(len(labels)), optims, color="none", edgecolor="k", hatch="//",
                 label="optimizer step (timed apart)")
        s_ax.bar_label(bars, fmt="%.1f", fontsize=8)
        s_ax.set_xticks(range(len(labels)), labels, fontsize=7)
        s_ax.set_ylim(0, 1.3 * max(steps))
        s_ax.set_ylabel("ms per step")
        s_ax.set_title(f"{speed['tokens_per_rank']} tokens per rank: ZeRO-3 / FSDP2 "
                       + ", ".join(f"{r:.2f}" for r in speed["ZeRO-3 / FSDP2"].values()),
                       fontsize=10)
        s_ax.legend(fontsize=7, loc="upper center")
    for ax in (k_ax, m_ax, s_ax):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{results[0]['device']}, {results[0]['world_size']} ranks")
    return _done(fig)
