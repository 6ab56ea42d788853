"""Committing a checkpoint atomically: a fresh directory, a rename, and the fsynced
``latest`` pointer; the helpers every rank agrees through."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


POINTER = "latest"              # the file, in a checkpoint root, naming the current checkpoint
_META = "_checkpoint"           # the entry holding the step
_COMMITTED = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_TMP = re.compile(r"^step-\d+\.tmp-[0-9a-f]+$")


# ------------------------------------------------------------------- commit and pointer


def _fresh_dir(root: str, step: int) -> str:
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"step-{step}.tmp-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    return tmp


def _commit(root: str, tmp: str, step: int, keep: int | None) -> str:
    if not os.path.isfile(os.path.join(tmp, ".metadata")):
        raise RuntimeError(f"DCP returned but wrote no .metadata in {tmp}")
    _fsync_dir(tmp)
    name, k = f"step-{step}", 1
    while os.path.exists(os.path.join(root, name)):   # never replace a committed checkpoint
        k += 1
        name = f"step-{step}.{k}"
    final = os.path.join(root, name)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f".{POINTER}.tmp-{secrets.token_hex(4)}")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, POINTER))
    _fsync_dir(root)
    _prune(root, name, keep)
    return final


def _prune(root: str, current: str, keep: int | None) -> None:
    """Remove abandoned ``*.tmp-*`` directories and, with ``keep``, the oldest checkpoints."""
    committed = []
    for entry in os.listdir(root):
        if _TMP.match(entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        elif (m := _COMMITTED.match(entry)) and entry != current:
            committed.append((int(m.group(1)), int(m.group(2) or 1), entry))
    if keep is not None:
        for *_, entry in sorted(committed)[:max(0, len(committed) - (keep - 1))]:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _resolve(path: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
    directory = latest(path)
    if directory is None:
        raise FileNotFoundError(f"no checkpoint at {path!r}: it has neither a {POINTER!r} "
                                f"pointer (written by distlab.checkpoint.save) nor a DCP "
                                f".metadata file")
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{path!r}'s {POINTER!r} names {directory!r}, which holds no "
                                f"complete checkpoint (no .metadata)")
    return directory


def _agree(group, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on group rank 0 and return its result on every rank (its exception, raised
    on every rank, when it fails)."""
    out = [None]
    if dist.get_rank(group) == 0:
        try:
            out = [("ok", fn())]
        except Exception as exc:  # sent to the other ranks, then raised everywhere
            out = [("error", exc)]
    dist.broadcast_object_list(out, src=dist.get_global_rank(group, 0) if group is not None
                               else 0, group=group)
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


@contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        yield


def _check_state(state) -> None:
    if not isinstance(state, dict) or not all(isinstance(k, str) and k for k in state):
        raise TypeError("state must be a dict with string keys, such as {'model': model, "
                        "'optim': optimizer}")
    if _META in state:
        raise ValueError(f"{_META!r} is reserved for the checkpoint's own entries")
    if any("." in k for k in state):
        raise ValueError(f"state keys may not contain '.' (DCP joins nested names with it): "
                         f"{[k for k in state if '.' in k]}")


def latest(path: str | os.PathLike) -> str | None:
    """The checkpoint directory ``path``'s ``latest`` pointer names (``path`` itself when it
    is a DCP checkpoint directory), or None when there is none."""
    root = os.fspath(path)
    pointer = os.path.join(root, POINTER)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            return os.path.join(root, f.read().strip())
    if os.path.isfile(os.path.join(root, ".metadata")):
        return root
    return None
