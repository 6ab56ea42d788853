"""Planning a run: which (dp, tp, pp) layouts of a dense GPT fit a cluster, and what each
costs per step, from the formulas of labs 05-07 and 10.

    plan = Plan(Model(layers=126, d_model=16384, heads=128, vocab=128256), seq_len=8192,
                global_batch=2048, gpus=16384, gpu_bytes=80e9, peak_flops=989.4e12,
                intra_bw=370e9, inter_bw=50e9, virtual_stages=8)
    layouts(plan)        # every layout, fitting or not, with its memory and times
    suggest(plan)        # the fitting layout with the shortest estimated step

A layout has ``t`` TP ranks, ``c = plan.cp`` context-parallel ranks (the sequence split
over them, lab 10), ``p`` stages of ``v = plan.virtual_stages`` chunks each (interleaved
1F1B, Narayanan et al. 2021, section 2.2.2; ``v = 1``: plain 1F1B) and ``d = gpus/(t c p)``
DP ranks, each taking ``B/d`` whole sequences as ``m = B/(d b)`` micro-batches of ``b``.
Ranks are ordered [TP, CP, PP, DP], innermost first (Llama 3 paper, section 3.3.2). Per
GPU and per step:

* **model states**: ZeRO's bytes (Rajbhandari et al. 2020; :func:`distlab.zero.memory.zero_bytes`)
  for the ``Ψ/(t p)`` parameters of one stage's TP shard, over the ``d c`` ranks that hold
  them, at the lowest ZeRO stage that fits;
* **activations**: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", section 4) per layer and micro-batch in bf16,
  ``s' b h (10 + 24/t)`` bytes with ``s' = s/c`` (``34 s' b h / t`` with sequence
  parallelism), the model of labs 05 and 07: FlashAttention (Dao et al. 2022) never stores
  the attention scores, so their ``5 a s' s b / t`` is counted only with
  ``flash_attention=False``. The first stage holds the layers of the micro-batches in
  flight (:func:`in_flight_layers`). With full recomputation each of those layers keeps
  its input, ``2 s' b h`` (``/t`` with sequence parallelism), and the layer being
  recomputed holds its whole set once more;
* **FLOPs**: Narayanan et al. 2021, eq. 3, generalised to any block: per token
  ``6 Ψ' + 12 L s h`` for the model (``Ψ'``: the parameters a token multiplies by, the
  head's ``V h`` once; ``12 L s h``: the attention scores and their product with the
  values, forward and backward), and with full recomputation the hardware does one more
  forward of the layers, ``2 (Ψ' - V h) + 4 L s h``; ``96 B s l h² (1 + s/6h + V/16lh)``
  for the GPT. The arithmetic runs at ``efficiency`` of the peak; the layout reports
  MFU (model FLOPs over the step, Chowdhery et al. 2023, as Llama 3 and Korthikanti et
  al. use it) and HFU (hardware FLOPs, recomputation included) apart;
* **TP**: 4 all-reduces of ``2 s' b h`` bytes per layer and micro-batch (Megatron's f and
  g, forward and backward, lab 06; 6 with recomputation) inside the node;
* **CP**: Llama 3's all-gather of K and V per layer and micro-batch (forward; their
  gradients reduce-scattered in backward; once more with recomputation): K and V of the
  whole sequence, ``4 s b h kv/(a t)`` bytes in bf16 per TP rank (``kv`` of the ``a``
  heads), over ``c`` ranks, inside the node when ``t c`` fits one, else on the network,
  on the critical path (Llama 3 paper, section 3.3.2);
* **PP**: one activation forward and one gradient back per micro-batch per boundary,
  ``v`` times with interleaving (each chunk has its own boundaries), on the network, each
  of the ``t`` TP ranks sending its ``1/t`` (Narayanan et al. 2021's scatter/gather,
  their figure 9; with sequence parallelism the activation is split already);
* **DP**: a reduce-scatter of the stage's bf16 gradients and an all-gather of its bf16
  weights per step over the ``d c`` ranks (ZeRO-1 and 2), hidden only under the last
  micro-batch's backward, when the gradients are complete; ZeRO-3 keeps no weights, so
  it gathers them for forward and again for backward, and reduce-scatters, for **every
  micro-batch**, prefetched under the compute;
* **bubble**: ``(p - 1)/(v m)`` of the busy time (Narayanan et al. 2021, section 2.2.2;
  the Llama 3 paper, section 3.3.2), as a fraction of the step
  :func:`distlab.pp.bubble_fraction` ``(p, v m)``.

Collectives cost ``bus_factor(op, n) · bytes / bandwidth`` (:func:`distlab.comm.bus_factor`:
the ring's ``2(n-1)/n`` for an all-reduce, ``(n-1)/n`` for the others). Left out:
mixture-of-experts layers (expert parallelism and its all-to-alls); selective
recomputation; a network's topology (every network byte on one GPU's share); Llama 3's
fp32 gradient reduce-scatter and its uneven first and last stages; the embedding's and the
loss's memory and time on the end stages; Llama 3's pipeline schedule (its tunable
number of consecutive micro-batches, section 3.3.2), whose memory differs from
Megatron-LM's; any overlap of TP's or CP's traffic with compute; latency (α) terms and
kernel launches; an efficiency that grows with the size of the matrices; causal
attention's halved score FLOPs (eq. 3 counts them whole). The activation formula
is the GPT block's (every head with its own keys and values, an MLP of width 4h);
``Model(kv_heads=, ffn=, gated=)`` changes the parameter count, the FLOPs and CP's
traffic, not the activations.
"""
from __future__ import annotations

import dataclasses

from distlab.comm import bus_factor
from distlab.pp import bubble_fraction
from distlab.zero.memory import zero_bytes

__all__ = ["Layout", "Model", "Plan", "activation_bytes", "divisors", "estimate",
           "flops_per_token", "in_flight_layers", "layer_activation_bytes", "layouts",
           "suggest"]


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

    @property
    def matmul_params(self) -> float:
        """The parameters a token multiplies by: all but an untied embedding's ``V h``
        (looked up, not multiplied); the head's ``V h`` counts once."""
        return self.num_params - (0 if self.tied else self.vocab * self.d_model)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run to plan: the model, ``global_batch`` sequences of ``seq_len`` tokens per step,
    ``gpus`` GPUs of ``gpu_bytes`` memory and ``peak_flops``, ``gpus_per_node`` to a node;
    bandwidths in bytes/s (bus bandwidth of an all-reduce inside a node; one GPU's share
    of the network); ``efficiency``: the fraction of the peak the arithmetic runs at
    (neither MFU nor HFU: both are the layout's, bubble and exposed traffic included);
    ``virtual_stages``: chunks per pipeline rank (interleaved 1F1B); ``cp``: the
    context-parallel degree."""

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
    efficiency: float = 0.4
    recompute: bool = False
    flash_attention: bool = True
    sequence_parallel: bool = False
    virtual_stages: int = 1
    cp: int = 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout's estimate: sizes, ZeRO stage (None: nothing fits), bytes per GPU,
    seconds per step, and the step's model and hardware FLOPs with the peak of all GPUs."""

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
    cp: int
    cp_s: float
    dp_hidden_s: float
    model_flops: float
    hardware_flops: float
    peak_flops: float

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.zero_stage is not None

    @property
    def step_s(self) -> float:
        """Compute, TP, CP and PP transfers (on the critical path) stretched by the
        bubble, plus the DP traffic the compute cannot hide."""
        busy = (self.compute_s + self.tp_s + self.cp_s + self.pp_s) / (1 - self.bubble)
        return busy + max(0.0, self.dp_s - self.dp_hidden_s)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs of a step over the step's time at
        the peak of all GPUs (recomputation not counted)."""
        return self.model_flops / (self.step_s * self.peak_flops)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: as :attr:`mfu`, recomputation's forward counted."""
        return self.hardware_flops / (self.step_s * self.peak_flops)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def flops_per_token(plan: Plan) -> tuple[float, float]:
    """(model, hardware) FLOPs per token of a training step (see the module): Narayanan
    et al. 2021, eq. 3, over ``B s`` tokens for the GPT."""
    model, s = plan.model, plan.seq_len
    attention = 4 * model.layers * s * model.d_model          # forward: Q K^T and P V
    forward = 2 * model.matmul_params + attention
    head = 2 * model.vocab * model.d_model
    extra = forward - head if plan.recompute else 0.0         # the layers once more
    return 3 * forward, 3 * forward + extra


def layer_activation_bytes(plan: Plan, tp: int, cp: int = 1) -> float:
    """What one layer keeps for backward, per micro-batch, bf16 (Korthikanti et al. 2022),
    for a rank's ``s/cp`` tokens: ``s' b h (10 + 24/t)``, ``34 s' b h / t`` with sequence
    parallelism, plus the attention scores' ``5 a s' s b / t`` without FlashAttention."""
    s, b, h, a = plan.seq_len / cp, plan.micro_batch, plan.model.d_model, plan.model.heads
    outside = 10 / tp if plan.sequence_parallel else 10    # norms, dropout, residuals
    scores = 0 if plan.flash_attention else 5 * a * s * plan.seq_len * b / tp
    return s * b * h * (outside + 24 / tp) + scores


def in_flight_layers(plan: Plan, pp: int, microbatches: int) -> float:
    """Layers' worth of activations the first stage holds at its peak: plain 1F1B,
    ``min(m, p)`` micro-batches of ``L/p`` layers (lab 07); interleaved, ``2(p-1) +
    (v-1)p + 1`` chunks of ``L/(p v)`` layers, at most all ``m v`` (the warm-up count of
    Megatron-LM's ``forward_backward_pipelining_with_interleaving``, plus the one in 1F1B),
    which is ``L (1 + (p-1)/(p v))`` once ``m`` is large."""
    layers, v = plan.model.layers, plan.virtual_stages if pp > 1 else 1
    if v == 1:
        return layers / pp * min(microbatches, pp)
    return layers / (pp * v) * min(microbatches * v, 2 * (pp - 1) + (v - 1) * pp + 1)


def activation_bytes(plan: Plan, tp: int, pp: int = 1, microbatches: int | None = None,
                     cp: int = 1) -> float:
    """Activations the first stage holds, per GPU (:func:`in_flight_layers` of them; all
    ``L`` for ``pp = 1``); with full recomputation each of those layers' input and one
    layer's whole set, the one recomputed."""
    layers = in_flight_layers(plan, pp, pp if microbatches is None else microbatches)
    layer = layer_activation_bytes(plan, tp, cp)
    if not plan.recompute:
        return layers * layer
    kept = 2 * plan.seq_len / cp * plan.micro_batch * plan.model.d_model
    kept /= tp if plan.sequence_parallel else 1
    return layers * kept + layer


def estimate(plan: Plan, dp: int, tp: int, pp: int) -> Layout:
    """One layout's memory and times (see the module); ``plan.cp`` ranks split each
    sequence, so ``dp tp pp plan.cp`` must be ``plan.gpus``."""
    model, psi, cp = plan.model, plan.model.num_params, plan.cp
    if dp * tp * pp * cp != plan.gpus:
        raise ValueError(f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} is not the plan's {plan.gpus} GPUs")
    if plan.global_batch % (dp * plan.micro_batch):
        raise ValueError(f"{plan.global_batch} sequences do not split into {dp} DP ranks of "
                         f"micro-batches of {plan.micro_batch}")
    m = plan.global_batch // (dp * plan.micro_batch)
    v = plan.virtual_stages if pp > 1 else 1
    local, holders = psi / (tp * pp), dp * cp            # one stage's TP shard; its holders
    act = activation_bytes(plan, tp, pp, m, cp)
    stage = next((z for z in (1, 2, 3)
                  if zero_bytes(local, holders, z) + act <= plan.gpu_bytes), None)
    states = zero_bytes(local, holders, stage or 1)
    tokens = plan.global_batch * plan.seq_len
    model_flops, hardware_flops = (f * tokens for f in flops_per_token(plan))
    compute = hardware_flops / (plan.gpus * plan.peak_flops * plan.efficiency)
    message = 2 * plan.seq_len / cp * plan.micro_batch * model.d_model   # bf16 activations
    passes = 3 if plan.recompute else 2            # forward, backward, recomputed forward
    tp_s = 0.0 if tp == 1 else (2 * passes * model.layers / pp * m
                                * bus_factor("all_reduce", tp) * message / plan.intra_bw)
    kv = 2 * 2 * plan.seq_len * plan.micro_batch * model.d_model / tp   # K and V, bf16
    kv *= (model.kv_heads or model.heads) / model.heads
    cp_bw = plan.intra_bw if tp * cp <= plan.gpus_per_node else plan.inter_bw
    cp_s = 0.0 if cp == 1 else (passes * model.layers / pp * m
                                * bus_factor("all_gather", cp) * kv / cp_bw)
    pp_s = 0.0 if pp == 1 else 2 * v * m * message / tp / plan.inter_bw
    one_pass = bus_factor("all_gather", holders) * 2 * local / plan.inter_bw
    if stage == 3:
        dp_s, hidden = 3 * m * one_pass, compute
    else:
        dp_s, hidden = 2 * one_pass, 2 / 3 * compute / m
    return Layout(dp, tp, pp, m, stage, states, act, compute, tp_s, pp_s,
                  0.0 if holders == 1 else dp_s, bubble_fraction(pp, v * m), cp, cp_s, hidden,
                  model_flops, hardware_flops, plan.gpus * plan.peak_flops)


def layouts(plan: Plan) -> list[Layout]:
    """Every layout whose sizes are whole: tp dividing the heads and at most a node, pp
    at most the layers, dp the rest, each DP rank's sequences whole micro-batches."""
    out = []
    ranks = plan.gpus // plan.cp if plan.gpus % plan.cp == 0 else 0
    for tp in divisors(plan.gpus_per_node):
        if plan.model.heads % tp or not ranks or ranks % tp:
            continue
        for pp in divisors(ranks // tp):
            if pp > plan.model.layers:
                continue
            dp = ranks // (tp * pp)
            if plan.global_batch % (dp * plan.micro_batch):
                continue
            out.append(estimate(plan, dp, tp, pp))
    return out


def suggest(plan: Plan) -> Layout | None:
    """The fitting layout with the shortest estimated step (None when none fits)."""
    fitting = [lay for lay in layouts(plan) if lay.fits]
    return min(fitting, key=lambda lay: lay.step_s, default=None)
