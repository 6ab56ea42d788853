"""Executing a schedule table: one training step of one pipeline stage.

    stage = Stage(GPT(cfg), index=dist.get_rank(), num_stages=dist.get_world_size())
    runner = PipelineRunner(stage, one_f_one_b_schedule(p, m))
    loss = runner.step(inputs, targets)    # the batch's mean loss on the last stage
    optimizer.step()

:meth:`PipelineRunner.step` runs this stage's row of the table over m micro-batches of
the global batch, exchanging activations and their gradients with the neighbouring
stages (:class:`distlab.pp.p2p.StageLink`), and gives the gradients of the batch's mean
loss, as one process computes them, tied parameters' summed over the stages holding
them; the optimizer step is the caller's. ``runner.timeline`` keeps what the stage did
and when (:mod:`distlab.pp.events`), with the number of micro-batches whose activations
it holds after each action. How it does it is lab 07's exercise ``run_stage`` (its
implementation lives in :mod:`distlab.reference.pp`).
"""
from distlab.reference.pp import PipelineRunner, cross_entropy, sum_tied_gradients

__all__ = ["PipelineRunner", "cross_entropy", "sum_tied_gradients"]
