"""Checkpoint and restart under torchrun's elastic agent (``torchrun --max-restarts``),
the failure handling that section 3's quorum replaces. When a worker dies, the agent
stops every other worker of the job, starts them all again (fresh processes), and
each resumes from the last checkpoint, redoing the steps since it.

:func:`elastic_train` is one rank of such a job, run by ``launch.run`` in place under
torchrun; :func:`lost` reads what it logged and :func:`quorum_lost` what a quorum
replica's calls returned (:func:`distlab.resilience.replicas.run`), each as the steps
lost and the seconds lost to the failure: the wall time beyond what the steps that
count would take at the run's median step.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from distlab import checkpoint
from distlab.resilience.quorum import die_by_sigkill


def join_attempt(timeout_s: float = 60.0) -> None:
    """Join the gloo group of this torchrun attempt (``TORCHELASTIC_RESTART_COUNT``) on
    the store torchrun names, under a prefix of the attempt's own: a restarted worker
    that joined without one could read an address of the first attempt's dead group
    there and fail to connect ("Gloo connectFullMesh failed", as three of our first four
    restarts did). ``launch.run`` then runs in this group."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s))
    prefix = f"distlab/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def elastic_train(job: dict, folder: str, every: int, kill_at: int) -> int:
    """One data-parallel rank under torchrun: resumes from the last checkpoint in
    ``folder`` (:mod:`distlab.checkpoint`, the model and optimizer), trains to step
    ``job["steps"]`` on ``job["batch"](rank, step)``, the gradients summed over every
    rank's rows and divided by their number (one process on all the rows), and
    checkpoints every ``every`` steps. In the first attempt (torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` 0) the last rank dies by SIGKILL while the others are
    in step ``kill_at``'s all-reduce. Rank 0 appends each step (attempt, step, wall-clock
    start and end) to ``folder/steps.jsonl``. Returns the step it resumed from."""
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = job["model"](seed=job["seed"])
    optimizer = job["optimizer"](model)
    state, root = {"model": model, "optim": optimizer}, os.path.join(folder, "ckpt")
    try:
        resumed = checkpoint.load(root, state)
    except FileNotFoundError:
        resumed = 0
    params = [p for p in model.parameters() if p.requires_grad]
    step = resumed
    while step < job["steps"]:
        start = time.time()
        batch = job["batch"](rank, step)
        optimizer.zero_grad(set_to_none=True)
        (job["loss"](model, batch) * len(batch[0])).backward()
        flat = torch.cat([p.grad.reshape(-1).double() for p in params] +
                         [torch.tensor([float(len(batch[0]))], dtype=torch.float64)])
        if attempt == 0 and rank == world - 1 and step == kill_at:
            die_by_sigkill()
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = (flat[offset:offset + p.numel()] / flat[-1]).reshape(p.shape).to(p.dtype)
            offset += p.numel()
        optimizer.step()
        step += 1
        if step % every == 0:
            checkpoint.save(root, state, step=step, keep=1)
        if rank == 0:
            with open(os.path.join(folder, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step - 1, "start": start,
                                    "end": time.time()}) + "\n")
    return resumed


def lost(folder: str, steps: int) -> dict:
    """What the failure cost the job that :func:`elastic_train` logged in ``folder``:
    ``steps_lost``, the steps run more than once; ``seconds_lost``, the wall time from
    the first step's start to the last step's end beyond ``steps`` steps at the median
    step; ``restart_s``, from the start of the step the rank died in to the first step
    of the next attempt; ``attempts``."""
    with open(os.path.join(folder, "steps.jsonl")) as f:
        log = [json.loads(line) for line in f]
    median = statistics.median(e["end"] - e["start"] for e in log)
    first = {e["attempt"]: e for e in reversed(log)}       # each attempt's first step
    before = max(e["end"] for e in log if e["attempt"] == 0)
    return {"steps_lost": len(log) - steps, "attempts": len(first),
            "seconds_lost": log[-1]["end"] - log[0]["start"] - steps * median,
            "restart_s": first[1]["start"] - before if 1 in first else None,
            "median_step_s": median}


def quorum_lost(calls: list[dict]) -> dict:
    """What the failure cost a quorum replica whose calls of ``fault_tolerant_step`` are
    ``calls`` (:func:`distlab.resilience.replicas.train`'s): ``steps_lost``, the calls
    that committed nothing; ``seconds_lost``, their seconds and the calls' beyond the
    median committed one."""
    committed = [c["seconds"] for c in calls if c["returned"][1] is not None]
    median = statistics.median(committed)
    return {"steps_lost": len(calls) - len(committed), "median_step_s": median,
            "seconds_lost": sum(c["seconds"] for c in calls) - len(committed) * median}
