"""What lab 09's core exercise, distributed_train_step, is trained on and held to.

In the ranks (:func:`train`): a small GPT whose every tensor has an odd number of
elements (9 features, 3 heads, 15 tokens, 7 positions), its parameters cut into odd-sized
buckets (:func:`plan`), so that over 2 ranks every shard is uneven and the all-gathers'
pieces reach the parameters only when their handles are waited. The harness records,
per step, the weights each forward read, how many reduce-scatters were issued when
backward's last gradient arrived, whether a full gradient survived the step, the
returned loss, AdamW's moments and the CommLog. In this process (:func:`one_process`):
the same training with ``torch.optim.AdamW`` on the group's whole batch.
"""
import functools
import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.model import GPT, config
from rounding import bounds

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

VOCAB, SEQ, BATCH, STEPS, CAP = 15, 7, 8, 3, 600
CFG = config("test", VOCAB, seq_len=SEQ, n_head=3, d_model=9)
LANG = NGramLanguage(VOCAB, 3, seed=0)
ADAMW = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
RS_OPS = ("reduce_scatter_tensor", "reduce_scatter")
AG_OPS = ("all_gather_into_tensor", "all_gather")
SCALE = 1024.0
UNUSED = "unused"  # a run of its own (a crash there fails its test only): a model with a
# parameter that no forward reads
# the options of each run of a launch; the expected results are those of one process
RUNS = {"fp64": dict(overlap=True), "no_overlap": dict(overlap=False),
        "scaled": dict(overlap=True, loss_scale=SCALE),
        "bf16": dict(overlap=True, autocast_dtype=torch.bfloat16)}


def make_model(dtype=torch.float64, unused=False):
    """The GPT; with ``unused``, one more parameter (5 elements, in the first bucket
    backward completes) that no forward reads, so it never gets a gradient."""
    torch.manual_seed(0)
    model = GPT(CFG).to(dtype)
    if unused:
        model.register_parameter(UNUSED, torch.nn.Parameter(torch.linspace(-1, 1, 5, dtype=dtype)))
    return model


def plan(model) -> list[list[str]]:
    """Parameter names per bucket: backward's order (the last layers first), each bucket
    at least CAP elements and odd-sized."""
    buckets, current, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        current.append(name)
        size += p.numel()
        if size >= CAP and size % 2:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def batch_of(step, offset=0, index=0, size=1):
    """Rows ``index`` of ``size`` of the batch of ``step`` (``offset``: another group's data)."""
    return LANG.batch(step + offset, BATCH, SEQ, index, size)


# ---------------------------------------------------------------------- in the ranks


def train(step_fn, runs, groups=None):
    """Each named run of ``runs`` (name -> options) for STEPS steps on this rank. With
    ``groups`` (lists of global ranks), each group trains on data of its own."""
    from distlab.zero import FlatParams

    rank = dist.get_rank()
    made = [dist.new_group(g) for g in groups] if groups else [None]
    members = groups or [list(range(dist.get_world_size()))]
    g = next(i for i, ranks in enumerate(members) if rank in ranks)
    group, index, size = made[g], members[g].index(rank), len(members[g])
    out = {}
    for name, options in runs.items():
        bf16 = options.get("autocast_dtype") is torch.bfloat16
        model = make_model(torch.float32 if bf16 else torch.float64, unused=name == UNUSED)
        params = dict(model.named_parameters())
        buckets = [FlatParams([(n, params[n]) for n in names], group,
                              torch.bfloat16 if bf16 else None) for names in plan(model)]
        seen, counts, current = [], [], {}
        _record(model, seen, counts, current)
        ours = hooks_on(model)
        state, losses, logs, kept, moments, hooks, fp32_losses = {}, [], [], [], None, [], []
        for step in range(STEPS):
            x, y = batch_of(step, 1000 * g, index, size)
            counts.append([])
            with CommLog() as log:
                current["log"] = log
                loss = step_fn(model, buckets, state, x, y, group, **options, **ADAMW)
                del current["log"]
            losses.append(loss if isinstance(loss, float) else repr(type(loss).__name__))
            logs.append(log.records())
            kept.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
            hooks.append(hooks_on(model) - ours)
            logits = current.pop("logits", None)
            fp32_losses.append(None if logits is None else F.cross_entropy(
                logits.flatten(0, 1), y.flatten()).item())
            if step == 0:
                moments = first_moments(state, len(buckets))
        for gather in state.get("gathers", []) if isinstance(state, dict) else []:
            gather.wait()
        out[name] = {"losses": losses, "seen": seen, "counts": [c[-1] if c else None for c in counts],
                     "logs": logs, "kept": kept, "moments": moments, "hooks": hooks,
                     "autocast": current.get("autocast", []), "fp32_losses": fp32_losses,
                     "master_dtypes": [str(b.master.dtype) for b in buckets],
                     "bounds": [(b.start, b.end) for b in buckets],
                     "weights": {n: p.detach().to(torch.float64, copy=True)
                                 for n, p in model.named_parameters()}}
    return out


def _record(model, seen: list, counts: list, current: dict) -> None:
    """Hooks that append to ``seen`` the weights each forward reads, to
    ``current["autocast"]`` the autocast dtype forward runs under (None: off), keep in
    ``current["logits"]`` forward's output in fp64, and append to ``counts[-1]``, at each
    gradient accumulated, the reduce-scatters ``current["log"]`` holds so far."""
    def before(*_):
        seen.append({n: p.detach().to(torch.float64, copy=True) for n, p in model.named_parameters()})
        on = torch.is_autocast_enabled("cpu")
        current.setdefault("autocast", []).append(
            str(torch.get_autocast_dtype("cpu")) if on else None)
    model.register_forward_pre_hook(before)
    model.register_forward_hook(lambda _m, _a, out: current.__setitem__(
        "logits", out.detach().to(torch.float64)))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: counts[-1].append(
            current["log"].count(RS_OPS) if "log" in current else -1))


def hooks_on(model) -> int:
    """Hooks registered on the model's modules and parameters (torch keeps them in these
    dicts; the public API offers only their handles)."""
    count = 0
    for module in model.modules():
        count += sum(len(getattr(module, d, None) or {}) for d in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
    for p in model.parameters():
        count += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        count += len(getattr(p, "_backward_hooks", None) or {})
    return count


def first_moments(state, buckets: int):
    """Copies of ``state["adamw"][i]["exp_avg"]``, or None where the state is not so."""
    adam = state.get("adamw") if isinstance(state, dict) else None
    if isinstance(adam, list) and len(adam) == buckets and all(
            isinstance(s, dict) and isinstance(s.get("exp_avg"), torch.Tensor) for s in adam):
        return [s["exp_avg"].detach().clone() for s in adam]
    return None


# ----------------------------------------------------------------- in the test process


@functools.cache
def one_process(offsets=(0,), dtype=torch.float64, steps=STEPS, unused=False):
    """torch.optim.AdamW on the whole batch of each step (the batches of ``offsets``,
    concatenated): per step the weights forward reads and the loss; the first step's
    exp_avg by name; the final weights. With ``unused``, the model's unused parameter
    is stepped with a zero gradient (torch skips a parameter whose grad is None)."""
    model = make_model(dtype, unused)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=False)
    seen, losses, first = [], [], None
    for step in range(steps):
        seen.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
        xs, ys = zip(*(batch_of(step, o) for o in offsets))
        loss = F.cross_entropy(model(torch.cat(xs)).flatten(0, 1), torch.cat(ys).flatten())
        loss.backward()
        if unused:
            getattr(model, UNUSED).grad = torch.zeros(5, dtype=dtype)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if first is None:
            first = {n: opt.state[p]["exp_avg"].double().clone()
                     for n, p in model.named_parameters()}
    return {"seen": seen, "losses": losses, "exp_avg": first,
            "weights": {n: p.detach().double().clone() for n, p in model.named_parameters()}}


# A correct answer may sum in yet another order than the three that measure rounding:
# the grader allows a thousand times their gap (about 1e-9 in fp64 here); the mistakes it
# names are off by 1e-4 or more.
GRADING_MULTIPLE = 1000


@functools.cache
def tolerance() -> float:
    """The fp64 checks' bound on a loss, weight or moment gap: GRADING_MULTIPLE times the
    largest gap another order of summation makes in one process (``rounding.bounds``)."""
    _, (loss_tol, weight_tol) = bounds(make_model, LANG, STEPS, BATCH, SEQ, ADAMW,
                                       GRADING_MULTIPLE)
    return max(loss_tol, *weight_tol.values())


def bucket_shard(values: dict, names: list[str], bounds) -> torch.Tensor:
    """This rank's shard (``bounds``) of a bucket's flat concatenation of ``values``."""
    flat = torch.cat([values[n].reshape(-1) for n in names])
    return flat[bounds[0]:bounds[1]]


def largest_gap(got: dict, want: dict) -> tuple[float, str]:
    gap, where = max(((got[n] - want[n]).abs().max().item(), n) for n in want)
    return gap, where
