"""What a result was measured on: software versions, the GPUs, the CPUs, the commit and
the date, without the machine's name. ``describe()`` reads it in a subprocess
(``python -m distlab.acceptance.environment`` prints it as JSON), so that the process
running the checks never creates a CUDA context of its own."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

FIELDS = ("torch", "cuda_runtime", "nccl", "cuda_driver", "gpus", "gpu_names",
          "compute_capability", "hardware", "python", "git_commit", "git_changes", "date")


def _nvidia_smi_driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe() -> dict:
    """This process's view (imports torch; queries the GPUs)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if n else None
    except Exception:  # a build without NCCL
        nccl = None
    gpus = ", ".join(f"{names.count(g)} x {g} ({p.total_memory / 2**30:.0f} GiB)"
                     for g, p in {nm: pr for nm, pr in zip(names, props)}.items()) or "no GPU"
    return {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "nccl": nccl,
            "cuda_driver": _nvidia_smi_driver() if n else None, "gpus": n,
            "gpu_names": names,
            "compute_capability": [f"{p.major}.{p.minor}" for p in props],
            "hardware": f"{gpus}; {os.cpu_count()} CPU cores ({_cpu_model()}); "
                        f"{platform.machine()}",
            "python": platform.python_version()}


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(root: Path) -> str:
    """$DISTLAB_GIT_COMMIT where set (a copy of a checkout, told which commit it is: its
    own .git, if any, may be older); else ``git rev-parse HEAD`` in ``root``; else
    "unknown"."""
    told = os.environ.get("DISTLAB_GIT_COMMIT", "").strip()
    return told or (_git(root, "rev-parse", "HEAD") or "").strip() or "unknown"


def git_changes(root: Path) -> list[str] | None:
    """The tracked files that differ from the commit (what ran was the commit plus
    these): $DISTLAB_GIT_CHANGES (comma-separated) where DISTLAB_GIT_COMMIT is set,
    else ``git status``; None where unknown."""
    if os.environ.get("DISTLAB_GIT_COMMIT", "").strip():
        told = os.environ.get("DISTLAB_GIT_CHANGES")
        return None if told is None else sorted(filter(None, told.split(",")))
    out = _git(root, "status", "--porcelain", "--untracked-files=no")
    return None if out is None else sorted(line[3:] for line in out.splitlines() if line[3:])


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def describe(root: Path, timeout: float = 120) -> dict:
    """Every field of :data:`FIELDS` (None where unknown; a "probe_error" when the probe
    failed), read in a subprocess limited to ``timeout`` seconds."""
    from distlab.acceptance.registry import child_env

    out = {k: None for k in FIELDS}
    out["gpus"], out["gpu_names"], out["compute_capability"] = 0, [], []
    try:
        done = subprocess.run([sys.executable, "-m", "distlab.acceptance.environment"],
                              capture_output=True, text=True, timeout=timeout, env=child_env())
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        out["probe_error"] = f"{type(exc).__name__}: {exc}"
    out["git_commit"], out["git_changes"] = git_commit(root), git_changes(root)
    out["date"] = now()
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
