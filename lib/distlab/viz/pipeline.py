"""Pipeline schedules, drawn: Gantt charts of timelines and an explorer widget.

:func:`plot_gantt` draws one timeline (events of :mod:`distlab.pp.events`, measured
or from the ideal clock of :func:`distlab.pp.schedule.simulate`): one row per stage,
stage 0 on top, one box per forward (F, solid) or backward (B, hatched), coloured by
micro-batch, transfers as thin grey bars under the boxes. The white space is the
bubble. A box's label is drawn at its full size where it fits (:mod:`distlab.viz.labels`):
"F3", or "3" in a narrow box. :class:`PipelineExplorer` puts the ideal schedule for any
p and m (sliders) above a measured run; without a widget front end it shows a picture.

matplotlib and ipywidgets are imported where they are used, so that importing this
module (the lab 07 exercises do, for the autograder) needs neither.
"""
from __future__ import annotations

import numpy as np

from distlab.pp.bubble import compute_events, idle_fraction, peak_live
from distlab.viz import png

LABEL_PT = 7          # the font size of a box's label ("F3", or "3" where that is too wide)


def _figure(ax, size):
    """``ax``'s figure, or a new one, closed so that a notebook shows it once: as the
    value the plotting function returns."""
    import matplotlib.pyplot as plt

    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=size)
    plt.close(fig)
    return fig, ax


def _colour(mb: int):
    import matplotlib

    return matplotlib.colormaps["tab20"](((2 * mb) % 20 + (mb // 10) % 2) / 20)


def gantt_key():
    """Legend handles and labels for a Gantt chart: what solid, hatched and grey mean
    (the colour and the label in a box name its micro-batch)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="0.85", edgecolor="0.2", linewidth=0.5),
               Patch(facecolor="0.85", edgecolor="0.2", linewidth=0.5, hatch="///"),
               Line2D([], [], color="0.55", linewidth=3)]
    labels = ["forward Fi (colour: micro-batch i)", "backward Bi",
              "transfer group (waiting for the peer included)"]
    return handles, labels


def plot_gantt(events: list[dict], ax=None, title: str = "", unit: str = "ms",
               num_stages: int | None = None, key: bool = True):
    """A Gantt chart of ``events`` on ``ax`` (a new figure when None). ``unit``: "ms"
    shows times in milliseconds from the first forward; "" leaves them as they are
    (ideal time units). The title gets the idle fraction and each stage's peak of live
    micro-batches; ``key`` puts :func:`gantt_key` under the axes. Transfers before the
    first forward or after the last backward (a stage waiting for its first input, or
    for the tied gradient) are cut off."""
    from matplotlib.patches import Rectangle  # added as artists: cheaper than barh's bars

    from distlab.viz.labels import box_label

    fig, ax = _figure(ax, (9, 2.8))
    work = compute_events(events)
    p = num_stages or 1 + max(e["stage"] for e in work)
    scale = 1e3 if unit == "ms" else 1.0
    t0 = min(e["start"] for e in work)
    span = (max(e["end"] for e in work) - t0) * scale
    for e in events:
        x = max(0.0, (e["start"] - t0) * scale)
        w = (e["end"] - t0) * scale - x
        if w <= 0:
            continue
        y = e["stage"]
        if e["kind"] == "comm":
            ax.add_artist(Rectangle((x, y + 0.31), w, 0.1, color="0.55", linewidth=0))
            continue
        forward = e["kind"] == "F"
        ax.add_artist(Rectangle((x, y - 0.33), w, 0.66, facecolor=_colour(e["mb"]),
                                edgecolor="0.2", linewidth=0.5, hatch=None if forward else "///",
                                alpha=1.0 if forward else 0.75))
        box_label(ax, x, x + w, y, (f"{e['kind']}{e['mb']}", f"{e['mb']}"), fontsize=LABEL_PT)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.45, -0.55)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"time ({unit})" if unit else "time (forward = 1)")
    peaks = peak_live(events)
    held = f"; peak live micro-batches {[peaks[s] for s in sorted(peaks)]}" if peaks else ""
    ax.set_title(f"{title}{': ' if title else ''}idle {idle_fraction(work, p):.1%}{held}",
                 fontsize=9)
    ax.grid(alpha=0.25, axis="x")
    if key:
        ax.legend(*gantt_key(), fontsize=7, ncol=3, loc="upper center",
                  bbox_to_anchor=(0.5, -0.3), frameon=False)
    return fig


def plot_live(events: list[dict], ax=None, unit: str = "ms", title: str = ""):
    """Micro-batches whose activations each stage holds, over time (a step line per
    stage): what a stage's activation memory follows."""
    fig, ax = _figure(ax, (9, 2.4))
    scale = 1e3 if unit == "ms" else 1.0
    t0 = min(e["start"] for e in compute_events(events))
    for s in sorted({e["stage"] for e in events if "live" in e}):
        mine = [e for e in events if e["stage"] == s and "live" in e]
        times = [0.0] + [(e["end"] - t0) * scale for e in mine]
        ax.step(times, [0] + [e["live"] for e in mine], where="post", label=f"stage {s}")
    ax.set_xlabel(f"time ({unit})" if unit else "time (forward = 1)")
    ax.set_ylabel("live micro-batches")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title or "activations held", fontsize=9)
    ax.grid(alpha=0.3)
    # beside the axes: GPipe's curves fill them from edge to edge
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def compare_figure(panels: dict[str, tuple[list[dict], str]], columns: int = 2):
    """Several Gantt charts, one per ``title -> (events, unit)``, ``columns`` a row."""
    import matplotlib.pyplot as plt

    rows = -(-len(panels) // columns)
    heights = [0.45 * (1 + max(e["stage"] for e in ev)) + 1.3 for ev, _ in panels.values()]
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, max(heights) * rows),
                             squeeze=False)
    for ax, (title, (events, unit)) in zip(axes.flat, panels.items()):
        plot_gantt(events, ax=ax, title=title, unit=unit, key=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    # one key for all panels, in a strip added under them
    height = fig.get_figheight()
    fig.set_figheight(height + 0.35)
    fig.subplots_adjust(bottom=1 - (1 - fig.subplotpars.bottom) * height / (height + 0.35))
    fig.legend(*gantt_key(), fontsize=8, ncol=3, loc="lower center", frameon=False)
    plt.close(fig)
    return fig


def plot_bubble(rows: list[dict], title: str = "", ax=None):
    """Idle fraction against the number of micro-batches m: ``rows`` of ``{"label",
    "m", "idle"}``, one line per label, and the formula (p-1)/(m+p-1) for each p in
    ``{"p"}`` of the rows (dashed)."""
    fig, ax = _figure(ax, (6.5, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["m"])
        ax.plot([r["m"] for r in mine], [100 * r["idle"] for r in mine], "o-", ms=4, label=label)
    ms = np.geomspace(min(r["m"] for r in rows), max(r["m"] for r in rows), 100)
    for p in sorted({r["p"] for r in rows}):
        ax.plot(ms, 100 * (p - 1) / (ms + p - 1), "--", color="0.3", lw=1,
                label=f"formula (p-1)/(m+p-1), p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["m"] for r in rows}), [str(m) for m in sorted({r["m"] for r in rows})])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle fraction (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "bubble: measured against the formula", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


class PipelineExplorer:
    """Sliders for p and m and a choice of schedule redraw the ideal schedule
    (``ideal(name, p, m)`` returns its events); under it, the measured run of the chosen
    schedule (``measured[name]``: the events of one recorded step), which follows the
    schedule but not the sliders, as its caption says. Both pictures keep one size
    whatever p and m, as wide as :data:`WIDTH_IN`, so that the page does not move and
    the labels stay at their font size. The sliders redraw when released, and each
    picture is drawn once. Displayed, it is its ipywidgets box (``.widget``); as a
    static output it shows both pictures of the current setting."""

    WIDTH_IN = 8.4   # inches at 100 dpi: narrower than a notebook cell on a laptop

    def __init__(self, ideal, measured: dict[str, list[dict]], p: int = 4, m: int = 8,
                 max_p: int = 8, max_m: int = 16):
        import ipywidgets as widgets

        self.ideal, self.measured, self.max_p = ideal, measured, max_p
        names = list(measured)
        self.schedule = widgets.ToggleButtons(options=names, value=names[0])
        slider = dict(continuous_update=False, style={"description_width": "initial"})
        self.p = widgets.IntSlider(value=p, min=1, max=max_p, description="stages p", **slider)
        self.m = widgets.IntSlider(value=m, min=1, max=max_m, description="micro-batches m",
                                   **slider)
        self.label = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.caption = widgets.HTML()
        self.measured_image = widgets.Image(format="png")
        self._frames: dict[tuple, bytes] = {}
        for w in (self.schedule, self.p, self.m):
            w.observe(lambda _: self.show(), names="value")
        self.widget = widgets.VBox(
            [widgets.HBox([self.schedule, self.p, self.m], layout=widgets.Layout(flex_flow="row wrap")),
             self.label, self.image, self.caption, self.measured_image],
            layout=widgets.Layout(align_items="flex-start"))
        self.show()

    def _measured_shape(self, name: str) -> tuple[int, int]:
        events = self.measured[name]
        return 1 + max(e["stage"] for e in events), len({e["mb"] for e in compute_events(events)})

    def _chart(self, events, title: str, unit: str, rows: int):
        """A Gantt chart of fixed size for ``rows`` stages, its key under it."""
        import matplotlib.pyplot as plt

        height = 0.3 * rows + 1.2
        fig, ax = plt.subplots(figsize=(self.WIDTH_IN, height))
        plt.close(fig)
        p = 1 + max(e["stage"] for e in events)
        plot_gantt(events, ax=ax, title=title, unit=unit, key=False)
        ax.set_ylim(max(p, rows) - 0.45, -0.55)
        fig.legend(*gantt_key(), fontsize=7, ncol=3, loc="lower center", frameon=False)
        fig.tight_layout(rect=(0, 0.25 / height, 1, 1))   # a quarter inch for the key
        return fig

    def ideal_figure(self):
        """The ideal schedule of the current setting, as tall for any p (max_p rows)."""
        name, p, m = self.schedule.value, self.p.value, self.m.value
        return self._chart(self.ideal(name, p, m), f"{name} ideal, p={p}, m={m}", "",
                           self.max_p)

    def measured_figure(self):
        name = self.schedule.value
        mp, mm = self._measured_shape(name)
        return self._chart(self.measured[name], f"{name} measured, p={mp}, m={mm}", "ms", mp)

    def figure(self):
        """Both charts, one under the other: the static picture."""
        name, p, m = self.schedule.value, self.p.value, self.m.value
        mp, mm = self._measured_shape(name)
        return compare_figure({f"{name} ideal, p={p}, m={m}": (self.ideal(name, p, m), ""),
                               f"{name} measured, p={mp}, m={mm}": (self.measured[name], "ms")},
                              columns=1)

    def _frame(self, key: tuple, draw) -> bytes:
        if key not in self._frames:
            self._frames[key] = png(draw(), tight=False)
        return self._frames[key]

    def show(self) -> None:
        name, p, m = self.schedule.value, self.p.value, self.m.value
        self.image.value = self._frame((name, p, m), self.ideal_figure)
        self.measured_image.value = self._frame((name,), self.measured_figure)
        mp, mm = self._measured_shape(name)
        self.label.value = (f"<b>{name}</b>, p = {p}, m = {m}: formula (p-1)/(m+p-1) = "
                            f"<b>{(p - 1) / (m + p - 1):.1%}</b> idle")
        self.caption.value = (f"Below: the measured {name} step (p = {mp}, m = {mm}). "
                              "It follows the schedule buttons, not the sliders: one step "
                              "was recorded per schedule.")

    def __repr__(self) -> str:
        return (f"PipelineExplorer({self.schedule.value}, p={self.p.value}, m={self.m.value}; "
                f"ideal schedule beside the measured one)")

    def _repr_mimebundle_(self, **kwargs):
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = repr(self)
        data["image/png"] = png(self.figure())
        return data
