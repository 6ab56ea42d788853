"""ZeRO stage 1: every rank keeps the whole model and whole gradients, but the optimizer
states (and the fp32 master weights) of one shard only (Rajbhandari et al. 2020, "ZeRO",
section 5.1, P_os).

:class:`ShardedOptimizer` is shaped like ``torch.distributed.optim.ZeroRedundancyOptimizer``
so that one can replace the other in a training loop:

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward()
    opt.step()          # mean gradient of this rank's shard, AdamW on it, all-gather

Each param group is one flat buffer per dtype and device (:class:`FlatParams`), split
over the ranks the ``torch.tensor_split`` way. ``optimizer_cls`` is built over the
*pieces* of this rank's shard (per parameter, the part inside the shard), so its state
exists for 1/N of the elements, per-parameter details stay exact (a parameter with no
gradient is skipped, each has its own step count, groups keep their hyperparameters),
and any ``torch.optim`` optimizer works. A model in bf16 or fp16 gets fp32 master
weights: the optimizer updates fp32 pieces and the all-gather sends them back cast.

Gradients, two ways:

* ``average_gradients=True`` (default): :meth:`step` averages them itself with one
  reduce-scatter, which yields just this rank's shard of the mean. With the all-gather
  that follows, a step moves 2Ψ per rank, as plain data parallelism does (the paper's
  section 7.2.1). The model is not wrapped in a data-parallel wrapper.
* ``average_gradients=False``: the gradients were already averaged by an all-reduce
  (:class:`distlab.dp.DataParallel`, or torch's DDP, which is how torch's
  ZeroRedundancyOptimizer is used): all-reduce, local update, all-gather, 3Ψ per rank.
  DeepSpeed's first ZeRO-1 did this, and its 2020-03-17 release replaced it with the
  reduce-scatter ("1.5x -> 1x" the traffic of data parallelism).
"""
from __future__ import annotations

import torch

from distlab.comm import check_group
from distlab.zero.flat import FlatParams
from distlab.zero.grads import reduce_grads


class ShardedOptimizer(torch.optim.Optimizer):
    """``ShardedOptimizer(params, optimizer_cls, group=None, average_gradients=True,
    **defaults)``: ``optimizer_cls(**defaults)`` over this rank's shard of ``params``
    (tensors or param-group dicts, as any torch optimizer takes them).

    ``param_groups`` are the groups of the whole parameters (so learning-rate schedulers
    work; their hyperparameters are copied to the local optimizer at each step), and
    ``optim`` is the local optimizer. ``state_dict()`` is a collective that returns,
    on every rank, the state of the whole model in ``optimizer_cls``'s own format (it
    loads into a plain ``optimizer_cls`` over the same parameters, and back into a
    ShardedOptimizer over any number of ranks with :meth:`load_state_dict`).
    """

    def __init__(self, params, optimizer_cls, group=None, average_gradients: bool = True,
                 **defaults):
        check_group(group, "ShardedOptimizer")
        self.group, self.average_gradients = group, average_gradients
        self.units: list[list[FlatParams]] = []     # per param group
        self._where: dict[int, tuple[FlatParams, int]] = {}
        self._reduced = False
        self.optim = None
        super().__init__(params, defaults)
        self.optim = optimizer_cls([self._local_group(g, u) for g, u in
                                    zip(self.param_groups, self.units)], **defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        kinds: dict[tuple, list] = {}
        for i, p in enumerate(group["params"]):
            kinds.setdefault((p.dtype, p.device), []).append(
                (f"group{len(self.units)}.param{i}", p))
        units = [FlatParams(named, self.group) for named in kinds.values()]
        for unit in units:
            for i, p in enumerate(unit.params):
                self._where[id(p)] = (unit, i)
        self.units.append(units)
        if self.optim is not None:
            self.optim.add_param_group(self._local_group(group, units))

    @staticmethod
    def _local_group(group: dict, units: list[FlatParams]) -> dict:
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [piece for unit in units for piece in unit.pieces]}

    def flat_params(self) -> list[FlatParams]:
        """The flat buffers (one per param group, dtype and device)."""
        return [unit for units in self.units for unit in units]

    def reduce_gradients(self) -> None:
        """Put this rank's shard of the mean gradient into the pieces (done by
        :meth:`step` when not called before; a loss scaler calls it to look at the
        reduced gradients first)."""
        if self._reduced:
            return
        if self.average_gradients:
            for pending in [reduce_grads(u, async_op=True) for u in self.flat_params()]:
                pending.wait()
        else:
            for unit in self.flat_params():
                unit.take_averaged_grads()
        self._reduced = True

    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients (see the class), step the local optimizer on this rank's
        shard, and all-gather the updated shards into every rank's parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        for ours, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in ours.items() if k != "params"})
        self.optim.step()
        for pending in [u.gather(async_op=True) for u in self.flat_params()]:
            pending.wait()
        self._discard_shard_grads()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._discard_shard_grads()

    def _discard_shard_grads(self) -> None:
        for unit in self.flat_params():
            unit.clear_piece_grads()
        self._reduced = False

    # ------------------------------------------------------------------ state dicts

    def state_dict(self) -> dict:
        """The whole optimizer state, as ``optimizer_cls`` over all the parameters would
        hold it (a collective: every rank must call it, and every rank gets it)."""
        state, groups, index = {}, [], 0
        for ours, local, units in zip(self.param_groups, self.optim.param_groups, self.units):
            gathered = {}
            for unit in units:
                gathered.update(self._gather_state(unit))
            ids = []
            for p in ours["params"]:
                if id(p) in gathered:
                    state[index] = gathered[id(p)]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in local.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def _gather_state(self, unit: FlatParams) -> dict[int, dict]:
        """id(param) -> its whole state, for the parameters of ``unit`` that have one."""
        local = [self.optim.state.get(piece, {}) for piece in unit.pieces]
        first = next((i for i, s in enumerate(local) if s), None)
        if first is None:
            return {}
        per_element = [k for k, v in local[first].items()
                       if _per_element(v, unit.pieces[first])]
        whole = {}
        for key in per_element:
            shard = torch.cat([s[key].reshape(-1).to(unit.master_dtype) if s else
                               unit.master.new_zeros(piece.numel())
                               for s, piece in zip(local, unit.pieces)])
            flat = unit.gather_flat(shard)
            for i, (p, off, n) in enumerate(zip(unit.params, unit.offsets, unit.numels)):
                whole.setdefault(i, {})[key] = flat[off:off + n].view(p.shape).clone()
        out = {}
        for i, s in enumerate(local):
            if s:
                out[id(unit.params[i])] = {k: (whole[i][k] if k in per_element else
                                               _copy(v)) for k, v in s.items()}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole-model state (from :meth:`state_dict`, or from a plain optimizer of
        the same class over the same parameters, on any number of ranks): each rank
        keeps the part of each state tensor that falls in its shard."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}: build it over the same groups")
        local_state, local_groups, local_index = {}, [], 0
        for ours, saved, units in zip(self.param_groups, saved_groups, self.units):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(f"a param group of the state has {len(saved['params'])} "
                                 f"parameters, this optimizer's {len(ours['params'])}")
            hyper = {k: v for k, v in saved.items() if k != "params"}
            ours.update(hyper)
            by_param = {id(p): state_dict["state"].get(i, state_dict["state"].get(str(i)))
                        for p, i in zip(ours["params"], saved["params"])}
            ids = []
            for unit in units:
                for p, piece, (lo, hi) in zip(unit.params, unit.pieces, unit.ranges):
                    whole = by_param[id(p)]
                    if whole:
                        local_state[local_index] = {
                            k: (v.reshape(-1)[lo:hi].clone() if _per_element(v, p) else _copy(v))
                            for k, v in whole.items()}
                    ids.append(local_index)
                    local_index += 1
            local_groups.append({**hyper, "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def _per_element(value, param) -> bool:
    """A state entry with one value per element of ``param`` (a moment), as opposed to
    a per-parameter one (a step count)."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
