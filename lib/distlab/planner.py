"""Planning a run: which (dp, tp, pp) layouts of a dense GPT fit a cluster, and what each
costs per step, from the formulas of labs 05-07.

    plan = Plan(Model(layers=126, d_model=16384, heads=128, vocab=128256), seq_len=8192,
                global_batch=2048, gpus=16384, gpu_bytes=80e9, peak_flops=989.4e12,
                intra_bw=370e9, inter_bw=50e9)
    layouts(plan)        # every layout, fitting or not, with its memory and times
    suggest(plan)        # the fitting layout with the shortest estimated step

Per GPU and per step, for a layout with ``t`` TP ranks (inside a node), ``p`` stages
and ``d = gpus / (t p)`` DP ranks, ``m = B / (d b)`` micro-batches of ``b`` sequences:

* **model states**: ZeRO's bytes (Rajbhandari et al. 2020; :func:`distlab.zero.memory.zero_bytes`)
  for the ``Ψ / (t p)`` parameters of one stage's TP shard, over ``d`` ranks, at the
  lowest ZeRO stage that fits;
* **activations**: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", section 4) per layer and micro-batch in bf16,
  ``s b h (10 + 24/t)`` bytes (``34 s b h / t`` with sequence parallelism), the same
  model as labs 05 and 07: FlashAttention (Dao et al. 2022) never stores the attention
  scores, so their ``5 a s² b / t`` is counted only with ``flash_attention=False``.
  1F1B's first stage holds ``L`` layers' worth (``p`` micro-batches of ``L/p`` layers,
  lab 07). With full recomputation each layer keeps its input, ``2 s b h`` (``/t`` with
  sequence parallelism), and the layer being recomputed holds its whole set once more;
* **TP**: 4 all-reduces of ``2 s b h`` bytes per layer and micro-batch (Megatron's f and g,
  forward and backward, lab 06; 6 with recomputation) at the intra-node bandwidth;
* **PP**: one activation forward and one gradient back per micro-batch per boundary,
  on the network;
* **DP**: a reduce-scatter and an all-gather of the stage's bf16 weights (ZeRO-3: a
  second all-gather, for backward), on the network; hidden under backward where it fits;
* **bubble**: ``(p - 1)/(m + p - 1)`` (:func:`distlab.pp.bubble_fraction`);
* **compute**: ``6 Ψ`` FLOPs per token (lab 04), ``8 Ψ`` with full recomputation (one
  more forward), at ``mfu`` of the peak.

Collectives cost ``bus_factor(op, n) · bytes / bandwidth`` (:func:`distlab.comm.bus_factor`:
the ring's ``2(n-1)/n`` for an all-reduce, ``(n-1)/n`` for the others). Outside the model:
mixture-of-experts layers (expert parallelism), context parallelism (a sequence split
over GPUs), selective recomputation, interleaved stages, and a network's topology. The
activation formula is the GPT block's (every head with its own keys and values, an MLP
of width 4h); ``Model(kv_heads=, ffn=, gated=)`` changes the parameter count only.
"""
from __future__ import annotations

import dataclasses

from distlab.comm import bus_factor
from distlab.pp import bubble_fraction
from distlab.zero.memory import zero_bytes

__all__ = ["Layout", "Model", "Plan", "activation_bytes", "divisors", "estimate",
           "layer_activation_bytes", "layouts", "suggest"]


@dataclasses.dataclass(frozen=True)
class Model:
    """A dense GPT's shape. ``params`` defaults to the count of the shape: per layer
    ``2 h² + 2 h² kv/a`` for attention (grouped-query attention: ``kv_heads`` of them) and
    ``2 h f`` for the MLP of width ``f`` (``3 h f`` gated, as SwiGLU), with ``f = 4 h`` and
    ``kv = a`` the GPT's ``12 h²``; plus ``V h`` for the embedding, twice if the head is
    not tied to it."""

    layers: int
    d_model: int
    heads: int
    vocab: int
    params: float | None = None
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    tied: bool = True

    @property
    def num_params(self) -> float:
        if self.params is not None:
            return self.params
        h, kv = self.d_model, self.kv_heads or self.heads
        ffn = self.ffn or 4 * h
        block = 2 * h * h + 2 * h * h * kv / self.heads + (3 if self.gated else 2) * h * ffn
        return self.layers * block + (1 if self.tied else 2) * self.vocab * h


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run to plan: the model, ``global_batch`` sequences of ``seq_len`` tokens per step,
    ``gpus`` GPUs of ``gpu_bytes`` memory, ``gpus_per_node`` to a node; bandwidths in
    bytes/s (bus bandwidth of an all-reduce inside a node; one GPU's share of the network)."""

    model: Model
    seq_len: int
    global_batch: int
    gpus: int
    gpu_bytes: float
    peak_flops: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int = 8
    micro_batch: int = 1
    mfu: float = 0.4
    recompute: bool = False
    flash_attention: bool = True
    sequence_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout's estimate: sizes, ZeRO stage (None: nothing fits), bytes per GPU and
    seconds per step."""

    dp: int
    tp: int
    pp: int
    microbatches: int
    zero_stage: int | None
    state_bytes: float
    activation_bytes: float
    compute_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    bubble: float

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.zero_stage is not None

    @property
    def step_s(self) -> float:
        """Compute stretched by the bubble, plus TP and PP transfers (on the critical
        path), plus whatever DP traffic backward (2/3 of the compute) cannot hide."""
        busy = (self.compute_s + self.tp_s + self.pp_s) / (1 - self.bubble)
        return busy + max(0.0, self.dp_s - 2 / 3 * self.compute_s)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layer_activation_bytes(plan: Plan, tp: int) -> float:
    """What one layer keeps for backward, per micro-batch, bf16 (Korthikanti et al. 2022):
    ``s b h (10 + 24/t)``, ``34 s b h / t`` with sequence parallelism, plus the attention
    scores' ``5 a s² b / t`` without FlashAttention."""
    s, b, h, a = plan.seq_len, plan.micro_batch, plan.model.d_model, plan.model.heads
    outside = 10 / tp if plan.sequence_parallel else 10    # norms, dropout, residuals
    scores = 0 if plan.flash_attention else 5 * a * s * s * b / tp
    return s * b * h * (outside + 24 / tp) + scores


def activation_bytes(plan: Plan, tp: int) -> float:
    """Activations 1F1B's first stage holds, per GPU: ``L`` layers' worth; with full
    recomputation each layer's input and one layer's whole set, the one recomputed."""
    layer = layer_activation_bytes(plan, tp)
    if not plan.recompute:
        return plan.model.layers * layer
    kept = 2 * plan.seq_len * plan.micro_batch * plan.model.d_model
    kept /= tp if plan.sequence_parallel else 1
    return plan.model.layers * kept + layer


def estimate(plan: Plan, dp: int, tp: int, pp: int) -> Layout:
    """One layout's memory and times (see the module)."""
    model, psi = plan.model, plan.model.num_params
    m = plan.global_batch // (dp * plan.micro_batch)
    local = psi / (tp * pp)
    act = activation_bytes(plan, tp)
    stage = next((z for z in (1, 2, 3) if zero_bytes(local, dp, z) + act <= plan.gpu_bytes),
                 None)
    states = zero_bytes(local, dp, stage or 1)
    tokens = plan.global_batch * plan.seq_len
    flops_per_token = (8 if plan.recompute else 6) * psi     # recomputation: a 2nd forward
    compute = flops_per_token * tokens / (plan.gpus * plan.peak_flops * plan.mfu)
    message = 2 * plan.seq_len * plan.micro_batch * model.d_model         # bf16 activations
    calls = 6 if plan.recompute else 4          # f and g: forward, backward, recomputed forward
    tp_s = 0.0 if tp == 1 else (calls * model.layers / pp * m * bus_factor("all_reduce", tp)
                                * message / plan.intra_bw)
    pp_s = 0.0 if pp == 1 else 2 * m * message / plan.inter_bw
    passes = 3 if stage == 3 else 2
    dp_s = 0.0 if dp == 1 else (passes * bus_factor("all_gather", dp) * 2 * local
                                / plan.inter_bw)
    return Layout(dp, tp, pp, m, stage, states, act, compute, tp_s, pp_s, dp_s,
                  bubble_fraction(pp, m) if m >= 1 else 1.0)


def layouts(plan: Plan) -> list[Layout]:
    """Every layout whose sizes are whole: tp dividing the heads and at most a node, pp
    at most the layers, dp the rest, with at least one micro-batch."""
    out = []
    for tp in divisors(plan.gpus_per_node):
        if plan.model.heads % tp or plan.gpus % tp:
            continue
        for pp in divisors(plan.gpus // tp):
            if pp > plan.model.layers:
                continue
            dp = plan.gpus // (tp * pp)
            if plan.global_batch < dp * plan.micro_batch:
                continue
            out.append(estimate(plan, dp, tp, pp))
    return out


def suggest(plan: Plan) -> Layout | None:
    """The fitting layout with the shortest estimated step (None when none fits)."""
    fitting = [lay for lay in layouts(plan) if lay.fits]
    return min(fitting, key=lambda lay: lay.step_s, default=None)
