"""distlab.planner: the layouts of a run, their memory and step time, from labs 05-07's
formulas; and the widget's table."""
import dataclasses

import pytest

from distlab.comm import bus_factor
from distlab.planner import Model, Plan, estimate, layer_activation_bytes, layouts, suggest
from distlab.pp import bubble_fraction
from distlab.zero.memory import zero_bytes

ONE_T = Plan(Model(layers=128, d_model=25600, heads=160, vocab=51200, params=1e12),
             seq_len=2048, global_batch=1024, gpus=1024, gpu_bytes=80e9,
             peak_flops=989.4e12, intra_bw=370e9, inter_bw=25e9, recompute=True)


def test_pure_data_parallel_is_zero_and_the_formulas_of_the_labs():
    lay = estimate(ONE_T, 1024, 1, 1)
    assert lay.zero_stage == 3                       # 1T does not fit with ZeRO-1 or -2
    assert lay.state_bytes == zero_bytes(1e12, 1024, 3) == 16e12 / 1024
    # recomputed: 2 s b h per layer kept, and one layer's 34 s b h while it is recomputed
    assert lay.activation_bytes == 128 * 2 * 2048 * 25600 + 34 * 2048 * 25600
    assert lay.compute_s == pytest.approx(8 * 1e12 * 1024 * 2048 / (1024 * 989.4e12 * 0.4))
    assert lay.microbatches == 1 and lay.bubble == 0 and lay.tp_s == lay.pp_s == 0
    # ZeRO-3: two all-gathers and a reduce-scatter of the bf16 weights per step
    assert lay.dp_s == pytest.approx(3 * bus_factor("all_gather", 1024) * 2e12 / 25e9)
    assert lay.dp_s > 2 / 3 * lay.compute_s          # the network, not memory, is the limit
    assert lay.step_s == pytest.approx(lay.compute_s + lay.dp_s - 2 / 3 * lay.compute_s)


def test_tensor_and_pipeline_terms():
    lay = estimate(ONE_T, 16, 8, 8)
    m = 1024 // 16
    assert lay.microbatches == m and lay.bubble == bubble_fraction(8, m)
    message = 2 * 2048 * 25600
    # 6 all-reduces per layer and micro-batch: forward, backward and the recomputed forward
    assert lay.tp_s == pytest.approx(6 * 128 / 8 * m * bus_factor("all_reduce", 8) * message / 370e9)
    assert lay.pp_s == pytest.approx(2 * m * message / 25e9)
    assert lay.state_bytes == zero_bytes(1e12 / 64, 16, lay.zero_stage)


def test_layouts_respect_the_node_the_heads_and_the_layers():
    plan = dataclasses.replace(ONE_T, model=dataclasses.replace(ONE_T.model, heads=12, layers=6))
    found = {(lay.dp, lay.tp, lay.pp) for lay in layouts(plan)}
    assert all(12 % tp == 0 and tp <= 8 and pp <= 6 and dp * tp * pp == 1024
               for dp, tp, pp in found)
    assert (1024, 1, 1) in found and not any(tp == 8 for _, tp, _ in found)


def test_suggest_is_the_fastest_that_fits_and_none_when_nothing_fits():
    best = suggest(ONE_T)
    fitting = [lay for lay in layouts(ONE_T) if lay.fits]
    assert best in fitting and best.step_s == min(lay.step_s for lay in fitting)
    assert suggest(dataclasses.replace(ONE_T, gpu_bytes=1e9)) is None
    without = dataclasses.replace(ONE_T, recompute=False)
    assert estimate(without, 1024, 1, 1).activation_bytes > estimate(ONE_T, 1024, 1, 1).activation_bytes


def test_the_widget_table_lists_the_suggestion():
    pytest.importorskip("ipywidgets")
    from distlab.viz.planner import Planner, table_text

    text = table_text(ONE_T)
    best = suggest(ONE_T)
    assert f"suggested: dp={best.dp}, tp={best.tp}, pp={best.pp}" in text
    widget = Planner(ONE_T)
    widget.inputs["gpu_bytes"].value = 1          # 1 GB: nothing fits
    assert "none" in widget.out.value and "none" in repr(widget)


def test_one_activation_model_with_labs_05_and_07():
    """FlashAttention by default: 34 s h bytes per layer and sequence at t = 1 (lab 05),
    34 s h / t with sequence parallelism (lab 07); the scores' 5 a s² / t only without it."""
    plain = dataclasses.replace(ONE_T, recompute=False)
    assert estimate(plain, 1024, 1, 1).activation_bytes == 128 * 34 * 2048 * 25600
    sp = dataclasses.replace(plain, sequence_parallel=True)
    assert layer_activation_bytes(sp, 8) == 34 * 2048 * 25600 / 8
    assert layer_activation_bytes(plain, 8) == 2048 * 25600 * (10 + 24 / 8)
    scores = dataclasses.replace(plain, flash_attention=False)
    assert layer_activation_bytes(scores, 8) - layer_activation_bytes(plain, 8) == 5 * 160 * 2048 ** 2 / 8
    # full recomputation: 8 Ψ per token against 6 Ψ
    assert estimate(ONE_T, 1024, 1, 1).compute_s == pytest.approx(
        8 / 6 * estimate(plain, 1024, 1, 1).compute_s)


def test_the_parameter_count_of_a_shape():
    """12 L h² + V h for the GPT; Llama 3.1 405B's shape (8 KV heads, SwiGLU of width
    53,248, untied head) counts its published 405B."""
    assert Model(layers=2, d_model=64, heads=4, vocab=100).num_params == 12 * 2 * 64 ** 2 + 100 * 64
    llama = Model(layers=126, d_model=16384, heads=128, vocab=128256, kv_heads=8, ffn=53248,
                  gated=True, tied=False)
    assert 405e9 < llama.num_params < 406e9


def test_the_widget_switches_change_the_activations():
    pytest.importorskip("ipywidgets")
    from distlab.viz.planner import Planner

    widget = Planner(dataclasses.replace(ONE_T, recompute=False, gpu_bytes=1e15))
    shown = widget.out.value
    widget.switches["flash_attention"].value = False      # the scores kept: more memory
    assert not widget.plan.flash_attention and widget.out.value != shown
    widget.switches["sequence_parallel"].value = True
    assert widget.plan.sequence_parallel


LLAMA_405B = Plan(Model(layers=126, d_model=16384, heads=128, vocab=128256, kv_heads=8, ffn=53248,
                        gated=True, tied=False),
                  seq_len=8192, global_batch=2048, gpus=16384, gpu_bytes=80e9,
                  peak_flops=989.4e12, intra_bw=370e9, inter_bw=50e9, recompute=True)


def test_the_widget_shows_rounded_sizes_and_plans_with_the_exact_ones():
    """405.849243648 billion parameters show as 405.8; the table stays the exact plan's
    until the box is changed; counts are whole numbers; the switches' labels are not
    pushed right by an indent (which cut "FlashAttention (no scores kept)" short)."""
    ipywidgets = pytest.importorskip("ipywidgets")
    from distlab.viz.planner import Planner, table_text

    widget = Planner(LLAMA_405B)
    assert widget.inputs["params"].value == 405.8
    assert widget.plan.model.num_params == LLAMA_405B.model.num_params
    assert repr(widget) == table_text(LLAMA_405B)
    assert all(isinstance(widget.inputs[name], ipywidgets.IntText)
               for name in ("layers", "d_model", "heads", "seq_len", "global_batch", "gpus"))
    assert widget.inputs["gpu_bytes"].value == 80 and widget.inputs["intra_bw"].value == 370
    widget.inputs["params"].value = 400
    assert widget.plan.model.num_params == 400e9
    for switch in widget.switches.values():
        assert switch.indent is False and switch.layout.width, switch.description


def test_the_widget_stored_without_a_run_says_to_run_it():
    """A notebook opened without running it shows the widget output's HTML or text (a
    fresh JupyterLab does not draw an untrusted notebook's widgets): both say the boxes
    come with a run, list the sizes, and hold the table."""
    pytest.importorskip("ipywidgets")
    from distlab.viz.planner import Planner, sizes_text

    data = Planner(LLAMA_405B)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    for kind in ("text/plain", "text/html"):
        assert "run this cell" in data[kind], kind
        assert "parameters (billions) 405.8" in data[kind] and "suggested: dp=" in data[kind]
    assert "recompute activations on" in sizes_text(LLAMA_405B)
