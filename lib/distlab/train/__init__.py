"""The final distributed train step: ZeRO-2 with overlap and mixed precision, on a
data × pipeline × tensor-parallel rank grid (:class:`distlab.mesh.Mesh`).

    mesh = Mesh(dp=2, pp=2, tp=2)                      # inside a launched function
    trainer = build(config("tiny", 64), mesh, precision="bf16", lr=1e-3)
    x, y = trainer.local_batch(lang, step, batch_size=16)
    loss = trainer.step((x, y), global_batch_size=16)  # the global batch's mean loss

What it composes (Narayanan et al. 2021, the 3D layout of Megatron-LM; Rajbhandari et
al. 2020, ZeRO): the GPT made tensor-parallel over ``mesh.tp_group``
(:func:`distlab.tp.tensor_parallel`), cut into ``pp`` stages run by a 1F1B pipeline over
``mesh.pp_group`` (:mod:`distlab.pp`), its trainable parameters in ZeRO-2 buckets over
``mesh.dp_group`` with fp32 master shards and AdamW's moments sharded, the gradients
reduce-scattered while backward runs (``overlap=True``, the default) or after it;
``precision`` is "bf16" (autocast, fp32 masters),
"fp16" (the same with a dynamic loss scale), "fp32" or "fp64" (the tests' reference
mode). A :class:`Trainer` is saved and loaded at another layout by :mod:`distlab.checkpoint`.

The composition (:mod:`distlab.train.trainer`, :mod:`distlab.train.compose`) is built
from the answers of labs 05-08. Issuing the reduce-scatters from backward is lab 09's
``distributed_train_step`` grown into the trainer, so that code is an answer
(:mod:`distlab.train.overlap`): read it after your step is graded. In a student
edition before lab 09's answers, ``overlap=False`` trains.

``python -m distlab.train --dp 2 --tp 2 --pp 2 --steps 20 --model tiny`` trains on
:class:`distlab.data.NGramLanguage` through :func:`distlab.launch.run` (gloo on CPUs),
or in-process under ``torchrun --nproc-per-node 8 -m distlab.train ...``.
"""
from distlab.train.cli import main
from distlab.train.compose import build, train
from distlab.train.precision import PRECISIONS
from distlab.train.trainer import Trainer

__all__ = ["PRECISIONS", "Trainer", "build", "main", "train"]
