"""nccl-tests (NVIDIA, BSD-3) as the bandwidth reference: built from source against the
NCCL that torch uses, then its ``*_perf`` binaries run with the bench's sizes and counts.

Sources, the first found: ``$DISTLAB_NCCL_TESTS_SRC`` (a folder with ``src/`` or a
``.tar.gz``), ``.ncclt/`` in the checkout (what ``../shared/tools/device-prep.sh``
unpacks for a machine without internet), ``../shared/vendor/nccl-tests-*.tar.gz`` beside
the checkout. The build (about 90 s on 16 cores) lands in ``$DISTLAB_NCCL_TESTS_BUILD``
(default ``/tmp/distlab-nccl-tests``) and is reused while its binaries are there.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tarfile
from pathlib import Path

from distlab.acceptance.registry import CheckError, Context

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv")


def nccl_home() -> Path:
    """The folder of the NCCL torch loads (the ``nvidia-nccl`` wheel of CUDA builds)."""
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        raise CheckError("no nvidia.nccl package (torch's NCCL): nccl-tests needs its headers "
                         "and library to build against")
    return Path(list(spec.submodule_search_locations)[0])


def cuda_home() -> Path:
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").exists():
        return default
    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise CheckError("no nvcc (CUDA's compiler): nccl-tests cannot be built here")
    return Path(nvcc).resolve().parents[1]


def find_sources(root: Path, work: Path) -> Path:
    """A folder holding nccl-tests' ``src/Makefile`` (a tarball is unpacked into ``work``)."""
    candidates = [Path(p) for p in [os.environ.get("DISTLAB_NCCL_TESTS_SRC")] if p]
    candidates += [root / ".ncclt", *sorted((root.parent / "shared" / "vendor").glob(
        "nccl-tests-*.tar.gz"))]
    for path in candidates:
        if (path / "src" / "Makefile").exists():
            return path
        if path.is_file() and path.name.endswith(".tar.gz"):
            dest = work / "nccl-tests-src"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            with tarfile.open(path) as tar:
                tar.extractall(dest, filter="data")
            found = [p.parents[1] for p in dest.rglob("src/Makefile")]
            if found:
                return min(found, key=lambda p: len(p.parts))
    raise CheckError("no nccl-tests sources: looked in " + ", ".join(map(str, candidates)) +
                     " (run ../shared/tools/device-prep.sh, or set DISTLAB_NCCL_TESTS_SRC)")


def build(ctx: Context, capability: str) -> tuple[Path, dict]:
    """(folder of the ``*_perf`` binaries, environment to run them in), building them
    for compute capability ``capability`` ("9.0") unless already built."""
    home = nccl_home()
    env = {"LD_LIBRARY_PATH": os.pathsep.join(
        filter(None, [str(home / "lib"), os.environ.get("LD_LIBRARY_PATH")]))}
    out = Path(os.environ.get("DISTLAB_NCCL_TESTS_BUILD", "/tmp/distlab-nccl-tests"))
    if all((out / f"{op}_perf").exists() for op in OPS):
        return out, env
    src = find_sources(ctx.root, ctx.scratch)
    # nccl-tests links -lnccl: give it a NCCL_HOME whose lib/libnccl.so is torch's libnccl.so.2
    shim = ctx.scratch / "nccl-home"
    (shim / "lib").mkdir(parents=True, exist_ok=True)
    for link, target in ((shim / "lib" / "libnccl.so", home / "lib" / "libnccl.so.2"),
                         (shim / "include", home / "include")):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    sm = capability.replace(".", "")
    proc = ctx.run(["make", "-C", src / "src", f"-j{os.cpu_count() or 4}", f"BUILDDIR={out}",
                    f"NCCL_HOME={shim}", f"CUDA_HOME={cuda_home()}",
                    f"NVCC_GENCODE=-gencode=arch=compute_{sm},code=sm_{sm}"],
                   log=ctx.scratch / "nccl-tests-build.txt")
    proc.check()
    missing = [op for op in OPS if not (out / f"{op}_perf").exists()]
    if missing:
        raise CheckError(f"nccl-tests built, but without {missing} in {out}")
    return out, env


def run_all(ctx: Context, binaries: Path, env: dict, gpus: int, folder: Path,
            args: tuple = ("-b", "8", "-e", "1G", "-f", "2", "-w", "10", "-n", "50"),
            limit: float = 120) -> Path:
    """Each op's ``<op>_perf ARGS -g GPUS`` (one process driving every GPU), its output in
    ``folder/<op>_perf.txt``, the layout ``python -m distlab.bench.collectives
    --nccl-tests`` reads. Returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for op in OPS:
        ctx.run([binaries / f"{op}_perf", *args, "-g", str(gpus)], limit=limit, env=env,
                log=folder / f"{op}_perf.txt").check()
    return folder
