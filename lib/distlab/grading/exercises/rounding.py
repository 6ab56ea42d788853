"""How far rounding alone moves a training run: the bound of the equivalence checks
(the kit's tests and the grader's, which import this module from here).

Two runs that add the same numbers in another order differ by rounding, and AdamW
(``m / (sqrt(v) + eps)``) turns a rounding difference on a gradient near zero into a
visible step: the gap depends on the machine's kernels (issue 30: one lab 09 check got
1.3e-12 on one CPU and less than 1e-12 on another). So the bound is measured, on the
machine that runs the test: the single process trained again with its rows reversed
and its gradient accumulated over 2 or 4 micro-batches, and, below float64, the same
run in float64 (how far the dtype's own rounding takes it from the exact run: a tensor
parallel run also reorders the sums inside each matmul, which the batch orders do not);
a correct distributed run stays within ``MULTIPLE`` times the largest gap that those
runs make, tensor by tensor (at least a few units in the last place of the tensor's
largest element).
"""
import torch
import torch.nn.functional as F

MULTIPLE = 10
ORDERS = ((False, 1), (True, 1), (False, 2), (True, 4))   # (rows reversed, micro-batches)


def adamw_run(model, lang, steps, batch, seq, adamw, order=(False, 1)):
    """``steps`` of ``torch.optim.AdamW(**adamw)`` on ``model``, each on the whole batch of
    its step, summed in ``order``: the losses and the final ``state_dict`` (copies)."""
    flip, parts = order
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for step in range(steps):
        x, y = lang.batch(step, batch, seq)
        x, y = (x.flip(0), y.flip(0)) if flip else (x, y)
        loss = 0.0
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            part = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()) * (len(xs) / len(x))
            part.backward()
            loss += part.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def bounds(make_model, lang, steps, batch, seq, adamw, multiple=MULTIPLE):
    """The reference run (the whole batch at once) and the tolerances around it:
    ``(losses, weights), (loss_tol, {name: weight_tol})``, ``multiple`` times the gaps.
    ``make_model()`` builds the same initial model at each call."""
    runs = [adamw_run(make_model(), lang, steps, batch, seq, adamw, order) for order in ORDERS]
    (losses, weights), others = runs[0], runs[1:]
    dtype = next(iter(weights.values())).dtype
    if dtype != torch.float64:
        others.append(adamw_run(make_model().double(), lang, steps, batch, seq, adamw))
    eps = torch.finfo(dtype).eps
    loss_gap = max(abs(a - b) for o in others for a, b in zip(o[0], losses))
    loss_tol = multiple * max(loss_gap, 4 * eps * max(map(abs, losses)))
    weight_tol = {}
    for name, w in weights.items():
        gap = max((o[1][name].to(w.dtype) - w).abs().max().item() for o in others)
        weight_tol[name] = multiple * max(gap, 4 * eps * w.abs().max().item())
    return (losses, weights), (loss_tol, weight_tol)


def assert_within(losses, weights, reference, tolerance, where=""):
    """``losses`` and ``weights`` against the ``bounds`` pair, each gap named if too wide."""
    (want_losses, want_weights), (loss_tol, weight_tol) = reference, tolerance
    gap = max(abs(a - b) for a, b in zip(losses, want_losses))
    assert len(losses) == len(want_losses) and gap <= loss_tol, (
        f"{where}losses {losses} against {want_losses}: gap {gap:.3g} > {loss_tol:.3g} "
        f"({MULTIPLE}x another order of summation's)")
    assert sorted(weights) == sorted(want_weights)
    for name, w in want_weights.items():
        gap = (weights[name].to(w.dtype) - w).abs().max().item()
        assert gap <= weight_tol[name], (f"{where}{name}: gap {gap:.3g} > {weight_tol[name]:.3g} "
                                         f"({MULTIPLE}x another order of summation's)")
