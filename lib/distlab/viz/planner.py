"""The planner widget of lab 09: a run's sizes in, the (dp, tp, pp) layouts that fit out,
with memory per GPU, communication per step, bubble and a suggestion. The formulas are
:mod:`distlab.planner`'s; this module only asks and shows.

Stored in a notebook and opened without running it (a fresh JupyterLab, which does not
draw the widgets of a notebook it has not trusted; GitHub; an HTML export), the planner
is its static fallback: a line saying that the boxes come when the cell runs, the sizes
the boxes start from, and the table, as HTML and as text.
"""
from __future__ import annotations

import dataclasses
import html

from distlab.planner import Model, Plan, layouts, suggest

FIELDS = (  # (Plan or Model field, label, scale shown to the user)
    ("params", "parameters (billions)", 1e9),
    ("layers", "layers", 1),
    ("d_model", "d_model", 1),
    ("heads", "heads", 1),
    ("seq_len", "sequence length", 1),
    ("global_batch", "global batch (sequences)", 1),
    ("gpus", "GPUs", 1),
    ("gpu_bytes", "GPU memory (GB)", 1e9),
    ("intra_bw", "NVLink bus bw (GB/s)", 1e9),
    ("inter_bw", "network per GPU (GB/s)", 1e9),
)
INTEGERS = {"layers", "d_model", "heads", "seq_len", "global_batch", "gpus"}
SWITCHES = (  # (Plan field, label)
    ("recompute", "recompute activations"),
    ("flash_attention", "FlashAttention (no scores kept)"),
    ("sequence_parallel", "sequence parallelism"),
)
STATIC_NOTE = ("A snapshot of the planner: run this cell to get its boxes and switches; "
               "the table then follows any change.")
BOX_WIDTH = "310px"      # a label and a box wide enough for 8 digits


def rows(plan: Plan, top: int = 8) -> list[dict]:
    """The ``top`` fitting layouts, fastest estimated step first (plain data)."""
    fitting = sorted((lay for lay in layouts(plan) if lay.fits), key=lambda lay: lay.step_s)
    return [dict(dp=lay.dp, tp=lay.tp, pp=lay.pp, zero=lay.zero_stage, m=lay.microbatches,
                 memory_gb=lay.memory_bytes / 1e9, tp_s=lay.tp_s, pp_s=lay.pp_s, dp_s=lay.dp_s,
                 bubble=lay.bubble, step_s=lay.step_s) for lay in fitting[:top]]


def table_text(plan: Plan, top: int = 8) -> str:
    found = rows(plan, top)
    total = len(layouts(plan))
    head = (f"{plan.model.num_params / 1e9:,.0f}B parameters on {plan.gpus:,} GPUs: "
            f"{sum(lay.fits for lay in layouts(plan))} of {total} layouts fit")
    if not found:
        return head + " (none: more GPUs, recomputation, or a shorter sequence)"
    lines = [head, "   dp  tp  pp  ZeRO     m   GB/GPU   TP s   PP s   DP s  bubble  step s"]
    lines += [f"{r['dp']:5} {r['tp']:3} {r['pp']:3} {r['zero']:5} {r['m']:5} {r['memory_gb']:8.1f} "
              f"{r['tp_s']:6.2f} {r['pp_s']:6.2f} {r['dp_s']:6.2f} {r['bubble']:7.1%} "
              f"{r['step_s']:7.2f}" for r in found]
    best = suggest(plan)
    lines.append(f"suggested: dp={best.dp}, tp={best.tp}, pp={best.pp}, ZeRO-{best.zero_stage}")
    return "\n".join(lines)


def shown(value: float, integer: bool = False) -> float | int:
    """``value`` as a box shows it: an integer whole, anything else to 4 significant
    digits (405.849243648 billion parameters: 405.8)."""
    if integer:
        return int(round(value))
    return float(f"{value:.4g}")


def _exact(plan: Plan, name: str) -> float:
    if name == "params":
        return plan.model.num_params
    return getattr(plan.model if hasattr(plan.model, name) else plan, name)


def sizes_text(plan: Plan) -> str:
    """The boxes and switches of the planner for ``plan``, on one line."""
    boxes = [f"{label} {shown(_exact(plan, name) / scale, name in INTEGERS):,g}"
             for name, label, scale in FIELDS]
    switches = [f"{label} {'on' if getattr(plan, name) else 'off'}" for name, label in SWITCHES]
    return "; ".join(boxes + switches)


class Planner:
    """Number boxes for the run's sizes, switches for recomputation, FlashAttention and
    sequence parallelism, and the table of :func:`table_text`, redrawn on every change.
    A box shows its value rounded (:func:`shown`); the plan keeps the exact value until
    the box is changed."""

    def __init__(self, plan: Plan):
        import ipywidgets as widgets

        self.plan = self.start = plan
        self.inputs = {}
        for name, label, scale in FIELDS:
            kind = widgets.IntText if name in INTEGERS else widgets.FloatText
            self.inputs[name] = kind(value=shown(_exact(plan, name) / scale, name in INTEGERS),
                                     description=label, style={"description_width": "initial"},
                                     layout=widgets.Layout(width=BOX_WIDTH))
        # indent=False: the label sits beside its box, whole, not after a label column
        self.switches = {name: widgets.Checkbox(value=getattr(plan, name), description=label,
                                                indent=False,
                                                layout=widgets.Layout(width=BOX_WIDTH))
                         for name, label in SWITCHES}
        self._shown = {name: box.value for name, box in self.inputs.items()}
        self.out = widgets.HTML()
        for w in [*self.inputs.values(), *self.switches.values()]:
            w.observe(lambda _: self.update(), names="value")
        # the boxes, then the switches, each in rows that wrap at the cell's width
        rows = [widgets.HBox(list(group.values()), layout=widgets.Layout(flex_flow="row wrap"))
                for group in (self.inputs, self.switches)]
        self.widget = widgets.VBox([*rows, self.out])
        self.update()

    def value(self, name: str) -> float:
        """The size of box ``name`` in the plan's units: the exact starting value while
        the box still shows it, else what the box holds."""
        scale = dict((n, s) for n, _, s in FIELDS)[name]
        box = self.inputs[name]
        if box.value == self._shown[name]:
            return _exact(self.start, name)
        return box.value * scale

    def update(self) -> None:
        v = {name: self.value(name) for name, _, _ in FIELDS}
        model = dataclasses.replace(self.plan.model, params=v["params"], layers=int(v["layers"]),
                                    d_model=int(v["d_model"]), heads=int(v["heads"]))
        self.plan = dataclasses.replace(
            self.plan, model=model, seq_len=int(v["seq_len"]), global_batch=int(v["global_batch"]),
            gpus=int(v["gpus"]), gpu_bytes=v["gpu_bytes"], intra_bw=v["intra_bw"],
            inter_bw=v["inter_bw"], **{k: w.value for k, w in self.switches.items()})
        try:
            text = table_text(self.plan)
        except (ValueError, ZeroDivisionError) as exc:   # a box at 0, a negative size
            text = f"no plan for these sizes: {exc}"
        self.out.value = f"<pre>{html.escape(text)}</pre>"

    def __repr__(self) -> str:
        return table_text(self.plan)

    def static_text(self) -> str:
        """What a notebook that was not run shows: the note, the sizes, the table."""
        return f"{STATIC_NOTE}\n{sizes_text(self.plan)}\n\n{table_text(self.plan)}"

    def static_html(self) -> str:
        return (f"<p><b>{html.escape(STATIC_NOTE)}</b></p>"
                f"<p>{html.escape(sizes_text(self.plan))}</p>"
                f"<pre>{html.escape(table_text(self.plan))}</pre>")

    def _repr_mimebundle_(self, **kwargs):
        # A front end with the widget manager draws the widget view (it ranks first and
        # the output is trusted, as every output a cell just made is); any other view
        # takes the first type it can show: the HTML, or the text.
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = self.static_text()
        data["text/html"] = self.static_html()
        return data


__all__ = ["Model", "Plan", "Planner", "rows", "shown", "sizes_text", "table_text"]
