"""ZeRO stages 2 and 3 as a module wrapper: gradients (stage 2) and parameters too
(stage 3) sharded over the ranks (Rajbhandari et al. 2020, "ZeRO", sections 5.2-5.3;
PyTorch's FSDP, Zhao et al. 2023, is the same idea): lab 05's answer ``ZeRO3Unit``,
grown to a whole model.

    model = FullyShardedDataParallel(GPT(cfg), compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's fp32 shard only
    loss_fn(model(x), y).backward()                        # gathers, frees, reduce-scatters
    model.finish_gradient_synchronization()
    opt.step()

The model is split into *units*: each element of every ``nn.ModuleList`` (the
transformer blocks) and the root (everything else: embeddings, final norm, head). Each
unit is one flat buffer (:class:`FlatParams`) sharded the ``torch.tensor_split`` way:
per rank, fp32 master weights of its shard, exposed as ``parameters()`` so that any
torch optimizer updates them, holding state for 1/N of the elements. A parameter shared
by two units (tied embeddings) belongs to the root.

Small parameters stay replicated, as DeepSpeed's ``stage3_param_persistence_threshold``
keeps them ("do not partition parameters smaller than this threshold"): by default
every parameter with one dimension or none (norm weights, biases), or, given
``persistence_threshold=n``, every parameter of at most ``n`` elements (0: none). They
form one more unit, kept whole on every rank (``FlatParams(..., replicate=True)``):
each keeps its shape in ``parameters()`` and gets the same averaged gradient on every
rank (one all-reduce of all of them per step, 2Ψ' for their Ψ' elements), so that code
which runs one collective per parameter, or compares them across ranks, sees the same
tensors everywhere. Outside forward the module holds their pieces (the master weights,
each with its averaged gradient after backward), as it holds the sharded units' pieces
in stage 3, so an optimizer over ``module.parameters()`` or code iterating the module
sees every gradient. A sharded parameter's piece is a 1-D slice of its unit's buffer,
whose size differs by rank (empty on some): FSDP2 (``fully_shard``) splits each
parameter along dim 0 instead, so that every piece keeps its parameter's meaning;
lab 05 says why torch moved there.

Per training step and unit, with hooks on the unmodified model:

* forward: all-gather the unit's parameters (cast to ``compute_dtype``) just before its
  forward; stage 3 frees them right after;
* backward (stage 3): all-gather them again just before the unit's backward (a hook on
  its outputs' gradients), free them after;
* when the unit's last gradient has been accumulated: reduce-scatter (mean) its
  gradients into this rank's shard, in fp32, and drop the full gradients.

The next unit's all-gather is issued asynchronously while this one computes (forward
and backward), and each reduce-scatter runs while the next unit's backward computes:
it is waited for (its shard added to the pieces' gradients, its buffers freed) when the
next one is issued, as FSDP2 does, so at most two units' gradient buffers are alive at
once, not every unit's until the end of backward. The all-gather of updated weights
happens at the next forward, after the optimizer step.
Traffic per step and rank: stage 2 an all-gather and a reduce-scatter of Ψ (2Ψ, like
data parallelism); stage 3 one more all-gather (3Ψ); the replicated parameters an
all-reduce (2Ψ') in both.

In fp32, a step at world size 2 is bitwise equal to :class:`distlab.dp.DataParallel`'s
(the same sum, then the same division by 2, of the same gradients), so it equals one
process wherever data parallelism does.

``shard_parameters=False`` gives stage 2: parameters stay whole on every rank between
steps (re-gathered at each forward), gradients and optimizer states are sharded.

Each forward must be followed by its backward before the next forward (micro-batches
accumulate: each backward adds its reduce-scattered shard to the pieces' gradients).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.backend import check_module_devices
from distlab.comm import check_group
from distlab.zero.collective import source_rank
from distlab.zero.flat import FlatParams
from distlab.zero.grads import reduce_grads


class _Unit:
    """One unit: its flat buffer, the module whose forward it wraps, and where each of
    its parameters is registered (``slots``) so the module can show the pieces while
    the full buffer is freed."""

    def __init__(self, flat: FlatParams, module: nn.Module | None, slots: list):
        self.flat, self.module, self.slots = flat, module, slots   # module None: replicated
        self.expected = sum(p.requires_grad for p in flat.params)
        self.deferred = any(not p.requires_grad for p in flat.params)
        self.ready = 0
        self.fresh = True      # the full buffer holds the current master weights

    def show(self, full: bool) -> None:
        for p, piece, places in zip(self.flat.params, self.flat.pieces, self.slots):
            for owner, attr in places:
                owner._parameters[attr] = p if full else piece


class FullyShardedDataParallel(nn.Module):
    """``FullyShardedDataParallel(module, compute_dtype=None, group=None,
    shard_parameters=True, units=None, prefetch=True, persistence_threshold=None)``:
    ZeRO stage 3 of ``module`` over the ranks of ``group`` (stage 2 with
    ``shard_parameters=False``).

    ``compute_dtype`` (e.g. ``torch.bfloat16``): the dtype of the gathered parameters
    and of the gradients' reduce-scatter; master weights stay fp32. ``units``: the
    submodules gathered one at a time (default: the elements of every ``nn.ModuleList``).
    ``persistence_threshold``: the parameters kept whole on every rank (None: those with
    at most one dimension; an int: those of at most that many elements; 0: none).
    Between steps in stage 3 ``.module``'s sharded parameters are this rank's pieces; use
    :meth:`gather_full_params` for the whole weights. Move the model to its device
    before wrapping it.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 group=None, shard_parameters: bool = True, units=None,
                 prefetch: bool = True, persistence_threshold: int | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got "
                            f"{type(module).__name__}")
        check_group(group, "FullyShardedDataParallel")
        check_module_devices(module)
        self.module, self.group = module, group
        self.shard_parameters, self.prefetch = shard_parameters, prefetch
        self._order: list[_Unit] = []     # forward order, recorded by the first forward
        self._order_known = False
        self._gathering: dict[_Unit, object] = {}
        self._reducing: list = []
        self._prepared: set[_Unit] = set()
        self._reduced: set[_Unit] = set()
        self._callback_queued = False
        self._units = self._build_units(module, compute_dtype, units, persistence_threshold)
        self._root = next((u for u in self._units if u.module is module), None)
        with torch.no_grad():
            for b in module.buffers():
                dist.broadcast(b, src=source_rank(group), group=group)
        me = weakref.ref(self)   # the model's hooks must not keep a dropped wrapper alive
        for i, unit in enumerate(self._units):
            if unit.module is not None and unit.module is not module:
                unit.module.register_forward_pre_hook(
                    functools.partial(_hook, me, "_pre_forward", i))
                unit.module.register_forward_hook(functools.partial(_hook, me, "_post_forward", i))
            for p in unit.flat.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        functools.partial(_hook, me, "_grad_ready", i))
            if shard_parameters and unit.module is not None:
                self._free(unit)
            elif unit.module is None:
                unit.show(full=False)

    def _build_units(self, module, compute_dtype, units, threshold) -> list[_Unit]:
        if units is None:
            units = []

            def walk(m):
                for child in m.children():
                    if isinstance(m, nn.ModuleList):
                        units.append(child)
                    else:
                        walk(child)

            walk(module)
        prefix = {id(m): name for name, m in module.named_modules()}
        for m in units:
            if id(m) not in prefix:
                raise ValueError(f"a unit ({type(m).__name__}) is not a submodule of the model")
        names: dict[int, list[str]] = {}
        slots: dict[int, list] = {}
        for owner_name, owner in module.named_modules(remove_duplicate=False):
            for attr, p in owner._parameters.items():
                if p is not None:
                    names.setdefault(id(p), []).append(f"{owner_name}.{attr}".lstrip("."))
                    slots.setdefault(id(p), []).append((owner, attr))
        canonical = list(module.named_parameters())
        owner_of = {}
        for m in units:
            lead = prefix[id(m)] + "."
            for _, p in canonical:
                if id(p) not in owner_of and all(n.startswith(lead) for n in names[id(p)]):
                    owner_of[id(p)] = m
        kept = [(n, p) for n, p in canonical if (p.dim() <= 1 if threshold is None
                                                 else p.numel() <= threshold)]
        for _, p in kept:
            owner_of[id(p)] = None
        out = []
        for m in list(units) + [module]:
            mine = [(n, p) for n, p in canonical if owner_of.get(id(p), module) is m]
            if mine:
                flat = FlatParams(mine, self.group, compute_dtype)
                out.append(_Unit(flat, m, [slots[id(p)] for _, p in mine]))
        if kept:
            flat = FlatParams(kept, self.group, compute_dtype, replicate=True)
            out.append(_Unit(flat, None, [slots[id(p)] for _, p in kept]))
        return out

    # ------------------------------------------------------------------ the step

    def forward(self, *args, **kwargs):
        self._start_iteration()
        if self._root is not None:
            self._pre_forward(self._root)
        out = self.module(*args, **kwargs)
        if self._root is not None:
            self._post_forward(self._root, None, None, out)
        for unit in self._units:
            if unit.module is None:       # the module shows the pieces, which get the gradient
                unit.show(full=False)
        self._order_known = True
        return out

    def _start_iteration(self) -> None:
        self.finish_gradient_synchronization()
        for unit in self._units:
            unit.ready = 0
            if unit.module is None:       # replicated: its compute copy from the updated master
                unit.flat.gather().wait()
                unit.show(full=True)
            elif not self.shard_parameters:
                unit.fresh = False        # stage 2: gather the updated weights once a step
        self._prepared.clear()
        self._reduced.clear()

    def _pre_forward(self, unit: _Unit, *_) -> None:
        if not self._order_known and unit not in self._order:
            self._order.append(unit)
        self._ensure_gathered(unit)
        unit.show(full=True)
        if self.prefetch and self._order_known:
            i = self._order.index(unit)
            if i + 1 < len(self._order):
                self._start_gather(self._order[i + 1])

    def _post_forward(self, unit: _Unit, _module, _args, output) -> None:
        if self.shard_parameters:
            self._free(unit)
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))

    def _pre_backward(self, unit: _Unit, _grad) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if unit in self._prepared or not self.shard_parameters:
            return
        self._prepared.add(unit)
        self._ensure_gathered(unit)
        if self.prefetch and unit in self._order:       # the unit whose backward comes next
            i = self._order.index(unit)
            after = self._order[-1] if i == 0 else self._order[i - 1]
            if after is not self._root and after is not unit and after not in self._reduced:
                self._start_gather(after)

    def _grad_ready(self, unit: _Unit, _param) -> None:
        unit.ready += 1
        if unit.ready == unit.expected and not unit.deferred:
            self._post_backward(unit)

    def _post_backward(self, unit: _Unit) -> None:
        if unit in self._reduced:
            return
        self._reduced.add(unit)
        pending = reduce_grads(unit.flat, async_op=True)
        for p in unit.flat.params:
            p.grad = None
        if self.shard_parameters and unit.module is not None:
            self._free(unit)
        self.finish_gradient_synchronization()    # the previous unit's, long done by now
        self._reducing.append(pending)

    def _end_backward(self) -> None:
        """Runs once at the end of each backward: reduce the units whose gradients were
        not all accumulated (frozen or unused parameters), then wait for every
        reduce-scatter, so the pieces hold their gradients when backward returns."""
        for unit in self._units:
            self._post_backward(unit)
        self.finish_gradient_synchronization()
        self._callback_queued = False

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradients' reduce-scatters (backward already waits for them at its
        end; kept for the shape of :class:`distlab.dp.DataParallel`)."""
        pending, self._reducing = self._reducing, []
        for p in pending:
            p.wait()

    # ----------------------------------------------------------- gather and free

    def _start_gather(self, unit: _Unit) -> None:
        if not unit.fresh and unit not in self._gathering:
            self._gathering[unit] = unit.flat.gather(async_op=True)

    def _ensure_gathered(self, unit: _Unit) -> None:
        if unit in self._gathering:
            self._gathering.pop(unit).wait()
        elif not unit.fresh:
            unit.flat.gather().wait()
        unit.fresh = True

    def _free(self, unit: _Unit) -> None:
        if unit in self._gathering:            # a prefetch nobody used: let it land first
            self._gathering.pop(unit).wait()
        unit.flat.free()
        unit.fresh = False
        unit.show(full=False)

    # ------------------------------------------------------------------- access

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """This rank's pieces of the master weights, under the model's parameter names:
        what the optimizer updates."""
        for unit in self._units:
            for name, piece in zip(unit.flat.names, unit.flat.pieces):
                yield prefix + name, piece

    def flat_params(self) -> list[FlatParams]:
        """The units' flat buffers: the blocks', the root's, then the replicated one
        (``replicated`` true)."""
        return [unit.flat for unit in self._units]

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, in the master dtype (fp32 or wider), by its name in
        the model (a collective: every rank calls it and gets the same)."""
        full = {}
        for unit in self._units:
            full.update(unit.flat.gather_master())
        return {name: full[name] for name, _ in self.named_parameters()}


def _hook(wrapper_ref, method: str, index: int, *args):
    """A hook on the model calls ``method`` of the wrapper on its ``index``-th unit, while
    the wrapper lives: hooks that held the wrapper or its units would keep every flat
    buffer alive as long as the model (through the parameters' C++ hook lists, which
    the garbage collector cannot see, not even after both are dropped)."""
    wrapper = wrapper_ref()
    if wrapper is not None:
        return getattr(wrapper, method)(wrapper._units[index], *args)
    return None


def _tensors(output):
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
