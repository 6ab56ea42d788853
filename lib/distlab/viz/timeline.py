"""Timelines of training steps (lab 08): what each rank computed and when each
collective ran, from a :class:`distlab.timeline.Timeline`; the step time against the
bucket size; and a widget that shows the timeline of the bucket size one picks.

Without a widget front end (GitHub, a static HTML export) the picker shows every
timeline it holds, one under the other. matplotlib and ipywidgets are imported where
they are used (importing this module needs neither).
"""
from __future__ import annotations

from distlab.timeline import COMM, Timeline
from distlab.viz import png

PHASES = {"forward": "#9ecae1", "backward": "#3182bd", "step": "#31a354", "wait": "#d9d9d9"}
KERNEL = "#6baed6"                 # GPU compute kernels (too many names for a legend)
COMM_COLOURS = ("#e6550d", "#fd8d3c")  # alternate, so that adjacent buckets stay apart
WIDTH_IN = 9.0     # inches at 100 dpi, key included: narrower than a notebook cell


def plot_timeline(timeline: Timeline, ax=None, title: str = "", label_bytes: bool = True):
    """Each rank as two rows: its computation (phases, or GPU kernels; "wait" is the
    host blocked on communication) and its collectives, with a tick where each
    gradient became ready and one where each collective was issued. Collectives in
    flight together queue for the same link, so the bars tile the time communication
    was in flight, in the order the collectives finished: each from when the one before
    it finished (or, after a gap, when a collective still to finish was issued) to when
    it finished; a bar's bytes are written in it where they fit. Time in ms from the
    earliest event."""
    import matplotlib.pyplot as plt

    from distlab.units import human_bytes
    from distlab.viz.labels import box_label

    ranks = timeline.ranks
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(
        figsize=(WIDTH_IN, 0.9 + 1.1 * len(ranks)))
    t0 = timeline.origin
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    ticks, labels = [], []
    seen = set()
    for row, rank in enumerate(reversed(ranks)):
        y_comp, y_comm = 3 * row + 1.45, 3 * row + 0.25
        ticks += [y_comm + 0.4, y_comp + 0.4]
        labels += [f"rank {rank} comm", f"rank {rank} compute"]
        groups: dict[str, list] = {}     # one broken_barh per phase: GPU traces hold
        for s in timeline.select(rank=rank):     # thousands of kernels
            if s.lane != COMM:
                groups.setdefault(s.name if s.name in PHASES else "GPU kernels", []).append(
                    (ms(s.start), 1e3 * s.seconds))
        for key, bars in groups.items():
            ax.broken_barh(bars, (y_comp, 0.8), facecolor=PHASES.get(key, KERNEL),
                           edgecolor="none", hatch="//" if key == "wait" else None,
                           label=None if key in seen else key)
            seen.add(key)
        comm = sorted(timeline.select(COMM, rank), key=lambda s: (s.end, s.start))
        first = [s.start for s in comm]  # the earliest issue among those not yet done
        for i in range(len(comm) - 2, -1, -1):
            first[i] = min(first[i], first[i + 1])
        previous = -float("inf")
        for i, s in enumerate(comm):     # the bars tile the union of [issued, done]
            left = max(first[i], previous)
            previous = s.end
            width = max(1e3 * (s.end - left), 1e-3)
            ax.broken_barh([(ms(left), width)], (y_comm, 0.8), facecolor=COMM_COLOURS[i % 2],
                           edgecolor="none", label=None if "collective" in seen else "collective")
            seen.add("collective")
            if label_bytes and s.nbytes:
                box_label(ax, ms(left), ms(left) + width, y_comm + 0.4, [human_bytes(s.nbytes)],
                          fontsize=7, color="white")
        if comm:
            ax.vlines([ms(s.start) for s in comm], y_comm - 0.2, y_comm, color="C3",
                      linewidth=0.6, label=None if "issued" in seen else "collective issued")
            seen.add("issued")
        marks = [ms(t) for r, _, t in timeline.marks if r == rank]
        if marks:
            ax.vlines(marks, y_comp + 0.8, y_comp + 1.05, color="k", linewidth=0.6,
                      label=None if "gradient ready" in seen else "gradient ready")
            seen.add("gradient ready")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(0, 3 * len(ranks))
    ax.set_xlim(left=0)
    ax.set_xlabel("time (ms)")
    hidden = timeline.hidden_fraction()
    note = f"communication hidden under compute: {hidden:.0%}" if hidden == hidden else ""
    ax.set_title("; ".join(t for t in (title, note) if t), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_step_times(sweep: dict, baselines: dict, title: str = "", ax=None):
    """Step time (ms) against the bucket size: ``sweep`` maps MiB → seconds per step of
    the bucketed version; ``baselines`` maps a name (naive, per-parameter, torch DDP)
    → seconds, drawn as horizontal lines."""
    import matplotlib.pyplot as plt

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4))
    caps = sorted(sweep)
    ax.plot(caps, [1e3 * sweep[c] for c in caps], marker="o", color="C3", label="bucketed")
    styles = {"naive": ("k", "--"), "per-parameter": ("C1", ":"), "torch DDP": ("C0", "-.")}
    for name, seconds in baselines.items():
        colour, line = styles.get(name, ("grey", "-"))
        ax.axhline(1e3 * seconds, color=colour, linestyle=line, linewidth=1.3,
                   label=f"{name} {1e3 * seconds:.0f} ms")
    ax.set_xscale("log", base=2)
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("time per step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def timelines_figure(timelines: dict, label_bytes: bool = True):
    """Every timeline of ``timelines`` (label → Timeline), one under the other, on a
    common time axis (so that a longer step draws longer): the static picture of
    :class:`TimelinePicker`. ``label_bytes`` as for :func:`plot_timeline`."""
    import matplotlib.pyplot as plt

    n = len(timelines)
    ranks = max(len(t.ranks) for t in timelines.values())
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH_IN, n * (0.9 + 1.1 * ranks)), squeeze=False)
    longest = max(1e3 * t.duration for t in timelines.values())
    for ax, (label, timeline) in zip(axes[:, 0], timelines.items()):
        plot_timeline(timeline, ax=ax, title=label, label_bytes=label_bytes)
        ax.set_xlim(0, longest * 1.02)
    fig.tight_layout()
    plt.close(fig)
    return fig


class TimelinePicker:
    """Pick a bucket size (or any label) and see its timeline; all drawn on the same
    time axis so that lengths compare. ``timelines`` maps a label to a Timeline.
    Displayed, it is its ipywidgets box (``.widget``): toggle buttons over a picture."""

    def __init__(self, timelines: dict, description: str = "bucket"):
        import ipywidgets as widgets

        if not timelines:
            raise ValueError("TimelinePicker needs at least one timeline")
        self.timelines = dict(timelines)
        self.longest = max(1e3 * t.duration for t in self.timelines.values())
        self.choice = widgets.ToggleButtons(options=list(self.timelines),
                                            description=description)
        self.image = widgets.Image(format="png")
        self._frames: dict[str, bytes] = {}
        self.choice.observe(lambda change: self.show(change["new"]), names="value")
        self.widget = widgets.VBox([self.choice, self.image],
                                   layout=widgets.Layout(align_items="flex-start"))
        self.show(self.choice.value)

    def figure(self, label: str):
        """The timeline of ``label`` on the time axis all of them share."""
        fig = plot_timeline(self.timelines[label], title=label)
        fig.axes[0].set_xlim(0, self.longest * 1.02)
        return fig

    def show(self, label: str) -> None:
        if label not in self._frames:
            self._frames[label] = png(self.figure(label))
        self.image.value = self._frames[label]

    def __repr__(self) -> str:
        return (f"TimelinePicker({len(self.timelines)} timelines: "
                f"{', '.join(self.timelines)}; showing {self.choice.value})")

    def _repr_mimebundle_(self, **kwargs):
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = repr(self)
        data["image/png"] = png(timelines_figure(self.timelines))
        return data
