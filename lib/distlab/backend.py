"""Which communication backend and device a rank uses, and what this machine offers.

NCCL (NVIDIA) and RCCL (AMD, in ROCm builds of torch) both appear to PyTorch as the
backend named ``"nccl"``; gloo runs the same collectives between CPU processes.
:func:`peak_flops` gives a device's dense peak throughput, for MFU.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

BACKENDS = ("auto", "nccl", "rccl", "gloo")

# Dense BF16/FP16 tensor-core peak, TFLOP/s, by a substring of the device name (the
# first that matches wins, so more specific names come first). Sources: NVIDIA A100,
# H100 and H200 datasheets (SXM parts; "with sparsity" halved), NVIDIA's H800 has the
# H100 SXM's compute (it differs in NVLink and FP64); AMD Instinct MI250X/MI300X specs.
PEAK_TFLOPS_BF16 = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("MI250X", 383.0),
)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a device for ``dtype`` ("bf16", "fp16"), or None if unknown
    (fp32, CPUs, devices missing from the table)."""
    if dtype not in ("bf16", "fp16"):
        return None
    for key, tflops in PEAK_TFLOPS_BF16:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


@dataclasses.dataclass(frozen=True)
class MachineInfo:
    """What this machine offers for collective communication."""

    torch_version: str
    gpus: int
    gpu_names: tuple[str, ...]
    cuda: str | None
    hip: str | None
    collective_library: str | None  # "NCCL 2.28.9" or "RCCL 2.x", None without GPUs
    gloo: bool

    def __str__(self) -> str:
        lines = [f"torch {self.torch_version}"]
        if self.gpus:
            names = ", ".join(sorted(set(self.gpu_names)))
            runtime = f"ROCm/HIP {self.hip}" if self.hip else f"CUDA {self.cuda}"
            lines.append(f"{self.gpus} GPU(s): {names} ({runtime})")
            lines.append(f"GPU collectives: {self.collective_library}")
        else:
            lines.append("no GPU: ranks are CPU processes talking through gloo")
        lines.append(f"gloo available: {self.gloo}")
        return "\n".join(lines)


def gpu_count() -> int:
    """GPUs torch can see (0 on CPU builds). Does not create a CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _collective_library() -> str | None:
    if not gpu_count() or not dist.is_nccl_available():
        return None
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return f"{'RCCL' if torch.version.hip else 'NCCL'} {version}"


def info() -> MachineInfo:
    n = gpu_count()
    return MachineInfo(
        torch_version=torch.__version__,
        gpus=n,
        gpu_names=tuple(torch.cuda.get_device_name(i) for i in range(n)),
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        collective_library=_collective_library(),
        gloo=dist.is_gloo_available(),
    )


def choose(world_size: int, backend: str = "auto") -> str:
    """The torch.distributed backend for ``world_size`` ranks on this machine.

    ``auto`` takes NCCL/RCCL only when every rank can have a GPU of its own (one GPU
    cannot hold two NCCL ranks), and gloo otherwise. Asking for NCCL without enough
    GPUs is an error that names the fix.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "gloo":
        return "gloo"
    if gpus < world_size or not dist.is_nccl_available():
        have = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU"
        raise ValueError(
            f"{backend} needs one GPU per rank: world_size={world_size} asks for {world_size} "
            f"GPUs but this machine has {have} (two ranks on one GPU fail with NCCL's "
            f"'Duplicate GPU detected'). Use backend='gloo' to run {world_size} CPU ranks, "
            f"or world_size<={gpus}." if gpus else
            f"{backend} needs one GPU per rank, and this machine has no GPU "
            f"(torch {torch.__version__}). Use backend='gloo' to run {world_size} CPU ranks."
        )
    return "nccl"


def explain(world_size: int, backend: str = "auto") -> str:
    """One sentence: which backend ``world_size`` ranks get here, and why."""
    name = choose(world_size, backend)
    gpus = gpu_count()
    if name == "nccl":
        lib = _collective_library()
        return f"{world_size} rank(s) on {lib}, one GPU each ({gpus} GPU(s) present)"
    why = "no GPU present" if not gpus else (
        "asked for" if backend == "gloo" else f"{world_size} ranks but only {gpus} GPU(s)")
    return f"{world_size} rank(s) on gloo, one CPU process each ({why})"


def device_for(local_rank: int, backend: str) -> torch.device:
    """The device rank ``local_rank`` computes on under ``backend``."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def device() -> torch.device:
    """This rank's device inside a launched function (CPU when no group is running)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_module_devices(module) -> None:
    """NCCL moves only CUDA tensors: say so before the first broadcast fails."""
    if dist.get_backend() != "nccl":
        return
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type != "cuda":
            raise ValueError(
                f"{name} is on {t.device} but the nccl backend needs CUDA tensors: move the "
                f"model with .to(distlab.backend.device()) before wrapping it")
