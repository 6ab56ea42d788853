# Lab 10's FP8 section (issue 34, section 3), in jupytext's percent format: to be spliced
# into solutions/10_long_context_experts.ipynb. Each "# %%" starts a code cell, each
# "# %% [markdown]" a markdown cell; the exercise cell carries its nbgrader metadata
# (grade_id fp8_linear, solution true) as the cell's options. The first code cell holds
# the imports this section needs (move them to the notebook's first cell if preferred).

# %% [markdown]
# ## 3. FP8 training
#
# The tensor cores of an H100 or H200 multiply FP8 matrices at twice their BF16 rate,
# and an FP8 operand is half the bytes to move. DeepSeek-V3 trained its 671B parameters
# with most matmuls in FP8. What is given up: an FP8 number has 8 bits for sign, exponent
# and mantissa together, so it has little precision *and* little range. Training in FP8
# means keeping a tensor inside that range with a **scale**, and choosing which format
# each tensor of a linear layer's three matmuls gets.
#
# `distlab.fp8` holds the formats and the scalings this section shows; `torchao`'s
# `float8` training is the production version the GPU section measures.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import fp8, launch
from distlab.comm import CommLog

print(f"{'format':<8}{'torch dtype':<16}{'largest':>10}{'smallest normal':>17}"
      f"{'smallest subnormal':>20}{'eps (2^-m)':>12}{'binades':>9}")
for name in fp8.FORMATS:
    d = fp8.describe(name)
    print(f"{name:<8}{d['dtype']:<16}{d['max']:>10g}{d['smallest normal']:>17.3g}"
          f"{d['smallest subnormal']:>20.3g}{d['eps']:>12g}{d['binades']:>9.1f}")
for dtype in (torch.bfloat16, torch.float32):
    info = torch.finfo(dtype)
    print(f"{str(dtype).removeprefix('torch.'):<8}{'':<16}{info.max:>10.3g}{info.tiny:>17.3g}"
          f"{info.tiny * info.eps:>20.3g}{info.eps:>12.3g}"
          f"{math.log2(info.max / (info.tiny * info.eps)):>9.1f}")

# %% [markdown]
# **E4M3** keeps one more mantissa bit (neighbouring values 2⁻³ apart, relative) and
# gives up range; **E5M2** keeps BF16's kind of range, coarser. The usual recipe
# (Micikevicius et al. 2022, torchao's default) puts the forward's operands, inputs and
# weights, in E4M3, and the gradients, whose magnitudes spread over many more binades,
# in E5M2. Either format covers far fewer binades than BF16: a tensor must be moved into
# the range before the cast.
#
# ### Scaling: where the tensor's largest value goes
#
# A tensor x is cast as `q = cast(x · s)` and read back as `q / s`. With
# `s = max_f / amax`, the tensor's largest magnitude amax lands on the format's largest
# value: nothing overflows, and the small values keep as many binades above the
# subnormals as the format has. Where amax comes from is the recipe:
#
# - **tensorwise dynamic:** the amax of this tensor, now (one pass over it before the
#   cast);
# - **rowwise:** one amax and one scale per row;
# - **delayed:** the largest amax of the last few steps, known before the tensor is
#   (no pass over it first, the scale can be fused into the producing kernel).
#
# The difference shows on a batch with an **outlier**: 64 rows of activations of unit
# size, one of whose elements is far larger (LLMs have such "massive activations" in a
# few channels). The cell casts the batch to E4M3 with each recipe, for outliers from
# 10 to 10⁶ times the others, and measures the error (SQNR, the signal over the error,
# in dB: each 6 dB is one bit) on the rows without the outlier, and on the outlier
# itself. The delayed scaler has seen 16 batches without the outlier.

# %%
def outlier_batch(size, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g)
    x[5, 17] = size
    return x


sizes = [10.0 ** e for e in (1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6)]
others = torch.arange(64) != 5
rows_db, outlier_err = {}, {}
for name in ("tensorwise", "rowwise", "delayed"):
    rows_db[name], outlier_err[name] = [], []
    for size in sizes:
        x = outlier_batch(size)
        if name == "delayed":
            scaler = fp8.DelayedScaling("e4m3", history=16)
            for step in range(16):
                scaler(torch.randn(64, 256, generator=torch.Generator().manual_seed(step + 1)))
            back = fp8.dequantize(*scaler(x))
        else:
            back = fp8.round_trip(x, "e4m3", rowwise=name == "rowwise")
        rows_db[name].append(fp8.sqnr(x[others], back[others]))
        outlier_err[name].append(abs(float(back[5, 17]) - size) / size)

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
for name, style in (("tensorwise", "o-"), ("rowwise", "s--"), ("delayed", "^:")):
    left.semilogx(sizes, rows_db[name], style, label=name)
    right.semilogx(sizes, [100 * e for e in outlier_err[name]], style, label=name)
left.set(xlabel="outlier / typical value", ylabel="SQNR of the other rows (dB)",
         title="E4M3: what the outlier costs the other rows")
right.set(xlabel="outlier / typical value", ylabel="error on the outlier (%)",
          title="... and what happens to the outlier")
left.legend(), right.legend()
fig.tight_layout()
plt.show()
for name in rows_db:
    print(f"{name:<11} other rows: {rows_db[name][0]:.1f} dB at an outlier of {sizes[0]:g}, "
          f"{rows_db[name][-1]:.1f} dB at {sizes[-1]:g}; the outlier's error at "
          f"{sizes[-1]:g}: {100 * outlier_err[name][-1]:.1f} %")

# %% [markdown]
# Read the two panels from left to right.
#
# - **Tensorwise:** one scale for all, so the larger the outlier, the smaller the other
#   rows' values after scaling. Nothing is lost while they stay among E4M3's normal
#   numbers, whose relative precision is the same at every magnitude (the outlier up to
#   about 2¹⁵ times their size: the normals' binades). Beyond, they sink into the
#   subnormals, which have fewer and fewer bits, and their SQNR collapses; the smallest
#   become 0. The outlier itself is exact to E4M3's precision.
# - **Rowwise:** only the outlier's row shares its scale; every other row keeps its own
#   and its full precision, whatever the outlier (its line hides the delayed one's on the
#   left). The price is a scale per row, which
#   the matmul must apply to its output (torchao's `rowwise` recipe; the hardware's
#   "scaled matmul" takes a vector of scales).
# - **Delayed:** the scale comes from the history, in which the outlier never was, so
#   the other rows keep their precision, but the outlier is **clipped** to the history's
#   amax (the cast saturates), an error that grows with it. The next step's history holds
#   it and the scale adapts, too late for this one. This is why recipes moved from
#   delayed to dynamic scaling once the amax pass could be fused.
#
# ### Under sharding: one amax for the whole tensor
#
# When a tensor is split over ranks (a batch over data-parallel ranks, a sequence over
# context-parallel ones), each rank sees only its shard's amax. If each rank scales by
# its own, the shards are cast with different scales: the rank that holds the outlier
# casts as the whole tensor would, the others use a larger scale, and the sharded
# tensor is no longer what one process would have computed. An all-reduce of one number
# with MAX gives every rank the whole tensor's amax; from there the cast is elementwise,
# so the sharded cast equals the unsharded one **bit for bit**. Two gloo ranks, each with
# half the rows of the batch above (the outlier in rank 0's half), compare their FP8
# bytes with the rows of one process's cast:

# %%
def sharded_cast(outlier, all_reduce):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = outlier_batch(outlier).tensor_split(world)[rank]
    with CommLog() as log:
        q, scale = fp8.quantize(mine, "e4m3", group=dist.group.WORLD if all_reduce else None)
    return q.view(torch.uint8), float(scale), log.records()


whole, _ = fp8.quantize(outlier_batch(1e3), "e4m3")
whole_rows = whole.view(torch.uint8).tensor_split(2)
for all_reduce in (False, True):
    ranks = launch.run(sharded_cast, 2, 1e3, all_reduce, backend="gloo")
    print("amax all-reduced with MAX:" if all_reduce else "each rank's own amax:")
    for rank, (q, scale, calls) in enumerate(ranks):
        same = torch.equal(q, whole_rows[rank])
        differ = int((q != whole_rows[rank]).sum())
        moved = ", ".join(f"{c['op']} of {c['nbytes']} bytes" for c in calls) or "no collective"
        print(f"  rank {rank}: scale {scale:.4g}; "
              + ("equal to one process's rows bit for bit" if same else
                 f"{differ} of {q.numel()} bytes differ from one process's rows")
              + f" ({moved})")

# %% [markdown]
# ### Exercise (warm-up): a linear layer with FP8 matmuls
#
# A linear layer's training step makes three matmuls, and FP8 training makes each one
# with FP8 operands: the output `y = x·Wᵀ`, the input's gradient `dx = dy·W` and the
# weight's gradient `dW = dyᵀ·x`. Here they are emulated on the CPU: cast to FP8,
# dequantized, multiplied in float32 (an FP8 tensor core also accumulates in higher
# precision), so the result is what the hardware would compute up to the summation order.
#
# **Exercise.** Write `fp8_linear(x, weight, bias=None, group=None)`. The contract:
#
# - **Inputs.** `x`: float32 of shape `(..., in)`, any number of leading dimensions
#   (tokens); `weight`: float32 `(out, in)`, the same on every rank of `group`; `bias`:
#   float32 `(out,)` or None. `group` (None: no sharding, one process): the ranks over
#   which the rows (leading dimensions) of `x` are split, each rank passing its own rows.
# - **Output.** A float32 tensor `(..., out)`, differentiable in `x`, `weight` and `bias`:
#   after `y.backward(dy)`, each of them that requires a gradient holds it in `.grad`.
# - **Casts.** Tensorwise dynamic scaling: a tensor t is cast with one scale
#   `s = max_f / amax(t)` (float32; `max_f` from `torch.finfo`, amax = the largest |value|
#   of the whole tensor), saturated at ±max_f, and read back as `q.float() / s`.
#   `x` and `weight` are cast to **e4m3** (`torch.float8_e4m3fn`), the output's gradient
#   `dy` to **e5m2** (`torch.float8_e5m2`). A tensor of zeros casts to zeros: nothing in
#   the result is ever nan or inf.
# - **Matmuls.** `y = x̂·Ŵᵀ + bias`, `dx = dŷ·Ŵ`, `dW = dŷᵀ·x̂` (summed over every leading
#   dimension), where `x̂, Ŵ, dŷ` are the casts read back; the multiplications in float32.
#   The bias and its gradient (`dy` summed over the rows, in float32) are not cast.
# - **Sharding.** With `group`, the amax of each cast of a row-sharded tensor (`x`, `dy`)
#   is the whole tensor's, over the group, so that each rank's `y` and `dx` equal bit
#   for bit its rows of the call with `group=None` on the whole batch. `dW` and the bias's
#   gradient are this rank's rows' contribution (data parallelism sums them later).
#   Traffic: forward and backward each make exactly one collective, an all-reduce of
#   one float32; with `group=None`, none.
# - **Precision.** Against the float32 layer, the SQNR of `y`, `dx` and `dW` is at least
#   20 dB on Gaussian data (torchao's own tests hold its float8 layer to this).
#
# **What the grader runs:** one process and 2 gloo ranks; probes that make each cast
# visible exactly (with the identity as weight, `y` is `x̂`, and `dx` is `dŷ`); a
# `(2, 12, 64)` input through a `64 → 48` layer against the float32 layer and against the
# casts; zeros; the rows of 25 tokens split 13 + 12 against the unsharded call, bit for
# bit; the collectives of each pass. `distlab.fp8`'s functions refuse while this
# exercise is graded: the cast is yours to write (a few lines), and reading
# `distlab/fp8.py` first defeats the exercise.
#
# <details><summary>Hint 1: what must backward have from forward?</summary>
#
# The weight's gradient needs `x̂`, the input's gradient `Ŵ`: the casts forward made, not
# the float32 tensors. A `torch.autograd.Function` keeps them with `ctx.save_for_backward`
# (in FP8: one byte per element, half what BF16 activations take) together with their
# scales, and its `backward(ctx, dy)` returns one gradient per input of `forward` (None for
# a bias that is None).
#
# </details>
#
# <details><summary>Hint 2: where does one rank's scale differ from one process's?</summary>
#
# Only in the amax: the multiplication, the clamp and the cast are elementwise. Compute
# the amax of your shard as a one-element float32 tensor and `dist.all_reduce` it with
# `op=dist.ReduceOp.MAX` over `group` before computing the scale, for `x` in forward and
# for `dy` in backward. The weight is the same on every rank, so its own amax is already
# the whole tensor's.
#
# </details>
#
# <details><summary>Hint 3: what does a tensor of zeros do to the scale?</summary>
#
# Its amax is 0, `max_f / 0` is inf, and `0 · inf` is nan. Floor the amax at a tiny
# positive number (say 1e-12) before dividing: a tensor of zeros then casts to zeros.
#
# </details>
#
# <details><summary>Hint 4: what is the whole sequence?</summary>
#
# `cast(t, dtype, group)`: `amax = t.detach().abs().amax().float()`, all-reduced with MAX
# when `group` is given; `s = torch.finfo(dtype).max / amax.clamp(min=1e-12)`;
# `q = (t.float() * s).clamp(-max, max).to(dtype)`; return `q, s`. Forward: cast `x`
# (group) and `weight` (no group) to e4m3, save both with their scales, return
# `(xq.float() / xs) @ (wq.float() / ws).t()` plus the bias. Backward: cast `dy` to e5m2
# (group); `dx = dŷ @ Ŵ`; `dW = dŷ.reshape(-1, out).t() @ x̂.reshape(-1, in)`; the bias's
# gradient `dy.reshape(-1, out).sum(0)`.
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "fp8_linear", "locked": false, "schema_version": 3, "solution": true}
# EXERCISE
def fp8_linear(x, weight, bias=None, group=None):
    """``x @ weight.T + bias`` with FP8 matmuls, emulated (see the contract above): x and
    weight cast to e4m3, the output's gradient to e5m2, one dynamic scale per tensor
    (the amax over ``group`` for the row-sharded x and gradient), dequantized and
    multiplied in float32. Differentiable in x, weight and bias."""
    ### BEGIN SOLUTION
    class FP8Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            xq, xs = _cast(x, torch.float8_e4m3fn, group)
            wq, ws = _cast(weight, torch.float8_e4m3fn, None)  # the same on every rank
            ctx.save_for_backward(xq, xs, wq, ws)
            ctx.has_bias = bias is not None
            y = (xq.float() / xs) @ (wq.float() / ws).t()
            return y + bias if bias is not None else y

        @staticmethod
        def backward(ctx, dy):
            xq, xs, wq, ws = ctx.saved_tensors
            gq, gs = _cast(dy, torch.float8_e5m2, group)
            g, xd, wd = gq.float() / gs, xq.float() / xs, wq.float() / ws
            dx = g @ wd
            dw = g.reshape(-1, g.shape[-1]).t() @ xd.reshape(-1, xd.shape[-1])
            db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
            return dx, dw, db

    return FP8Linear.apply(x, weight, bias)


def _cast(t, dtype, group):
    """(t cast to ``dtype``, its scale): tensorwise dynamic, the amax over ``group``."""
    amax = t.detach().abs().amax().float()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    top = torch.finfo(dtype).max
    scale = top / amax.clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(dtype), scale
    ### END SOLUTION

# %% [markdown]
# **Check.** A `(4, 32, 256)` input through a `256 → 512` layer, against the float32
# layer (SQNR of the output and both gradients); then the same rows split over 2 gloo
# ranks, against the unsharded call, bit for bit.

# %%
def layer_case():
    g = torch.Generator().manual_seed(10)
    return (torch.randn(4, 32, 256, generator=g), 0.05 * torch.randn(512, 256, generator=g),
            torch.randn(512, generator=g), torch.randn(4, 32, 512, generator=g))


def forward_backward(layer, x, w, b, dy, *group):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = layer(x, w, b, *group)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


x, w, b, dy = layer_case()
ours = forward_backward(fp8_linear, x, w, b, dy)
exact = forward_backward(F.linear, x, w, b, dy)
for name, a, e in zip(("output", "dx", "dW", "bias grad"), ours, exact):
    print(f"{name:<10} SQNR against float32: {fp8.sqnr(e, a):6.1f} dB")
    if name != "bias grad":
        assert fp8.sqnr(e, a) >= 20, name


def sharded_layer():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, w, b, dy = layer_case()
    mine_x, mine_dy = (t.tensor_split(world)[rank] for t in (x, dy))
    with CommLog() as log:
        y, dx, dw, db = forward_backward(fp8_linear, mine_x, w, b, mine_dy, dist.group.WORLD)
    return y, dx, dw, log.count("all_reduce")


for rank, (y, dx, dw, calls) in enumerate(launch.run(sharded_layer, 2, backend="gloo")):
    same = torch.equal(y, ours[0].tensor_split(2)[rank]) and torch.equal(dx, ours[1].tensor_split(2)[rank])
    print(f"rank {rank}: output and dx {'equal' if same else 'DIFFER from'} the unsharded "
          f"call's rows bit for bit; {calls} all-reduces of one number")

# %% [markdown]
# Then grade it from a terminal: `make grade LAB=10`.
#
# ### On a GPU: torchao's float8 training against BF16
#
# The emulation above has the numerics; the speed comes from the hardware's scaled FP8
# matmul (`torch._scaled_mm`), and what stands around it: the amax passes and the casts
# must be fused into neighbouring kernels, or they cost more than the matmul saves.
# `torchao.float8` (`convert_to_float8_training`, the `tensorwise` recipe, with the casts
# fused by `torch.compile`) is the well-kept production version. Its numerics are the
# contract above: emulated on a CPU, its output and both gradients equal those of
# `distlab.fp8`'s casts to float32 rounding (`tests/test_fp8.py` checks it).
# The acceptance check `fp8` (one GPU, `python -m distlab.bench.fp8`) measures, against
# BF16, both compiled:
#
# - a linear layer's forward and backward, casts included, on shapes (tokens, in, out)
#   from small to large: where FP8 starts to pay (the crossover shape), and the speedup
#   at the largest;
# - the kit's GPT, a training step at the 98M preset and at a 1.25B configuration
#   (24 layers, d_model 2048, sequences of 2048 tokens), in tokens per second, with
#   BF16's model FLOPs utilisation;
# - the loss curves of both precisions over a few hundred steps of the same batches of
#   the synthetic language, from the same initial weights.

# %%
from distlab.acceptance.render import show
from distlab.bench import fp8 as fp8_bench

result = show("fp8")
if result is not None:
    fp8_bench.draw(result["figures"])
    plt.show()

# %% [markdown]
# Where FP8 pays: a matmul's FP8 speedup needs enough work per byte cast. The casts are
# memory-bound passes over the operands, of the order of the tensors' size, while the
# matmul's work grows with their product; so small and thin shapes lose (the casts and
# the kernel launches dominate), and the speedup approaches the tensor cores' 2× only
# as all three dimensions grow. A GPT step gains less than its matmuls do: attention's
# softmax, the norms and the optimizer stay in BF16/FP32.
#
# <!-- not measured: 2× (the datasheets' FP8 over BF16 peak) -->
