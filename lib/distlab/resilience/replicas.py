"""Data-parallel replicas that are jobs of their own, as torchft runs them: each replica
is one ``launch.run`` (its own processes, its own timeout), all of them meeting on a
lighthouse served by the caller, so that a replica that dies takes no other down.

:func:`run` starts them from threads, kills the last one in the middle of an all-reduce
when asked (its :class:`~distlab.resilience.quorum.Manager`'s ``kill_in_step``), and
then starts a replacement in its place, let in at a later step: the run a
fault-tolerant step must survive without a restart.
"""
from __future__ import annotations

import os
import threading
import time

from distlab import launch
from distlab.resilience.quorum import Manager, connect, lighthouse


def train(step_fn, port, replica, replicas, job, kill_in_step=None, replacement=False):
    """One replica's loop, in its launch: ``step_fn(model, optimizer, batch, loss_fn,
    manager, step)`` until step ``job["steps"]``; the replicas that were there from the
    start wait at ``job["rejoin_at"]`` until a replacement is ready. Returns each call's
    step, what it returned, its quorum and its seconds; the final weights and optimizer
    state (``job["state"]``) and this process's pid."""
    store = connect(port)
    manager = Manager(store, replica, replicas, timeout_s=job.get("timeout_s", 3.0),
                      kill_in_step=kill_in_step)
    model = job["model"](seed=job["seed"] + 100 * replacement)   # a replacement: other weights
    optimizer = job["optimizer"](model)
    if replacement:
        store.set("replacement/ready", "1")
    else:                                # the first round: every replica of the run started
        store.add("started", 1)
        while store.add("started", 0) < replicas:
            time.sleep(0.005)
    step, calls = 0, []
    while step < job["steps"]:
        if step == job.get("rejoin_at") and not replacement and replicas > 1:
            store.wait(["replacement/ready"])
        start = time.perf_counter()
        try:
            got = step_fn(model, optimizer, job["batch"](replica, step), job["loss"], manager, step)
        except Exception as exc:  # the step's own error: reported, the loop ends
            calls.append({"step": step, "raised": f"{type(exc).__name__}: {exc}"})
            break
        q = manager.last_quorum
        calls.append({"step": step, "seconds": time.perf_counter() - start,
                      "returned": list(got) if isinstance(got, tuple) else repr(got),
                      "members": list(q.members) if q else [],
                      "steps": {str(k): v for k, v in (q.steps.items() if q else ())}})
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], int)):
            break
        step = got[0]
    return {"calls": calls, "state": job["state"](model, optimizer), "pid": os.getpid()}


def run(step_fn, replicas, job, kill_in_step=None, timeout=60):
    """Every replica's :func:`train` answer, or its launch's error: {replica id: ...}, and
    with ``kill_in_step``, {"replacement": ...}: the last replica dies by SIGKILL in that
    step's all-reduce, then a fresh one takes its id back."""
    store = lighthouse()
    found = {}

    def one(replica):
        victim = kill_in_step is not None and replica == replicas - 1
        for key, kill, fresh in ((replica, kill_in_step if victim else None, False),
                                 ("replacement", None, True))[:1 + victim]:
            try:
                found[key] = launch.run(train, 1, step_fn, store.port, replica, replicas, job,
                                        kill, fresh, backend="gloo", timeout=timeout,
                                        isolated=True)[0]
            except launch.LaunchError as exc:
                found[key] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found
