"""The planner widget of lab 09: a run's sizes in, the (dp, tp, pp) layouts that fit out,
with memory per GPU, communication per step, bubble and a suggestion. The formulas are
:mod:`distlab.planner`'s; this module only asks and shows. As a static output (no widget
front end) it is its table, as text and HTML.
"""
from __future__ import annotations

import dataclasses

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


class Planner:
    """Text boxes for the run's sizes, switches for recomputation, FlashAttention and
    sequence parallelism, and the table of :func:`table_text`, redrawn on every change."""

    def __init__(self, plan: Plan):
        import ipywidgets as widgets

        self.plan = plan
        self.inputs = {}
        for name, label, scale in FIELDS:
            value = getattr(plan.model if hasattr(plan.model, name) else plan, name)
            if name == "params":
                value = plan.model.num_params
            self.inputs[name] = widgets.FloatText(value=value / scale, description=label,
                                                  style={"description_width": "initial"})
        self.switches = {
            "recompute": widgets.Checkbox(value=plan.recompute, description="recompute activations"),
            "flash_attention": widgets.Checkbox(value=plan.flash_attention,
                                                description="FlashAttention (no scores kept)"),
            "sequence_parallel": widgets.Checkbox(value=plan.sequence_parallel,
                                                  description="sequence parallelism"),
        }
        self.out = widgets.HTML()
        for w in [*self.inputs.values(), *self.switches.values()]:
            w.observe(lambda _: self.update(), names="value")
        boxes = list(self.inputs.values()) + list(self.switches.values())
        self.widget = widgets.VBox([widgets.HBox(boxes[i:i + 3]) for i in range(0, len(boxes), 3)]
                                   + [self.out])
        self.update()

    def update(self) -> None:
        v = {name: self.inputs[name].value * scale for name, _, scale in FIELDS}
        model = dataclasses.replace(self.plan.model, params=v["params"], layers=int(v["layers"]),
                                    d_model=int(v["d_model"]), heads=int(v["heads"]))
        self.plan = dataclasses.replace(
            self.plan, model=model, seq_len=int(v["seq_len"]), global_batch=int(v["global_batch"]),
            gpus=int(v["gpus"]), gpu_bytes=v["gpu_bytes"], intra_bw=v["intra_bw"],
            inter_bw=v["inter_bw"], **{k: w.value for k, w in self.switches.items()})
        self.out.value = f"<pre>{table_text(self.plan)}</pre>"

    def __repr__(self) -> str:
        return table_text(self.plan)

    def _repr_mimebundle_(self, **kwargs):
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = repr(self)
        return data


__all__ = ["Model", "Plan", "Planner", "rows", "table_text"]
