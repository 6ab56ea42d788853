"""JupyterLab on the labs, as ``make lab`` starts it: ``python -m distlab.jupyter [FOLDER]``.

- **As root** (a Docker container, many cloud GPU machines, some JupyterHub images)
  JupyterLab refuses to start without ``--allow-root``; the kit passes it for root only.
- **With no display** (a remote GPU machine reached over SSH) no browser is opened, the
  server listens on the loopback interface only, and the way in from a laptop is printed:
  an SSH tunnel to that port, then the address with its token that JupyterLab prints.
- **No pop-ups**: the environment's ``overrides.json`` turns JupyterLab's news feed and
  update check off (they would also reach for the network).
- **Not modified by opening**: JupyterLab writes its kernel's ``kernelspec`` and
  ``language_info`` (the Python version to the patch level) into a notebook it opens,
  which then shows as modified; the labs are given this environment's first.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from distlab.grading.output import replace_file

PORT = 8888
# JupyterLab's settings that the kit sets for every user of this environment
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                             "checkForUpdates": False}}


def headless() -> bool:
    """True where no browser can open here: Linux with no X or Wayland display, or a
    shell reached over SSH."""
    remote = bool(os.environ.get("SSH_CONNECTION"))
    no_display = sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return remote or no_display


def command(notebook_dir: Path, port: int = PORT, *extra: str) -> list[str]:
    """The ``jupyter lab`` command line over ``notebook_dir`` (``extra``: further options)."""
    jupyter = shutil.which("jupyter", path=str(Path(sys.executable).parent)) or "jupyter"
    ours = [f"--notebook-dir={notebook_dir}", f"--ServerApp.port={port}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        ours.append("--allow-root")
    if headless():
        ours += ["--ServerApp.open_browser=False", "--ServerApp.ip=127.0.0.1"]
    named = {option.split("=")[0] for option in extra}  # JupyterLab takes each option once
    return [jupyter, "lab", *(o for o in ours if o.split("=")[0] not in named), *extra]


def write_overrides(prefix: Path = Path(sys.prefix)) -> Path | None:
    """Merge :data:`OVERRIDES` into ``prefix``'s ``share/jupyter/lab/settings/overrides.json``
    (where JupyterLab reads an environment's defaults); the file, or None where it cannot
    be written (JupyterLab then shows its news pop-up, nothing worse)."""
    path = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    try:
        current = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        current = {}
    merged = {**current, **{key: {**current.get(key, {}), **value}
                            for key, value in OVERRIDES.items()}}
    if merged == current:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(merged, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def kernel_metadata() -> dict:
    """The notebook metadata JupyterLab writes on opening a notebook with this
    environment's ``python3`` kernel. The kernel's language_info is read in a child
    process: importing ipykernel here would make this process pass for a notebook kernel
    (tqdm.auto, for one, then draws widgets)."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    info = subprocess.run([sys.executable, "-c", _LANGUAGE_INFO], capture_output=True,
                          text=True, check=True, timeout=60).stdout
    return {"kernelspec": {"display_name": spec.display_name, "language": spec.language,
                           "name": "python3"},
            "language_info": json.loads(info)}


_LANGUAGE_INFO = ("import json; from ipykernel.ipkernel import IPythonKernel; "
                  "print(json.dumps(IPythonKernel.language_info))")


def match_kernel(folder: Path) -> list[Path]:
    """Give each notebook of ``folder`` that runs on the ``python3`` kernel this
    environment's kernel metadata where it has another; the notebooks changed. Only those
    two metadata entries change, written whole or not at all
    (:func:`distlab.grading.output.replace_file`); a link, a file that is not a readable
    notebook, or one on another kernel is left as it is."""
    import nbformat

    want = kernel_metadata()
    changed = []
    for path in sorted(Path(folder).glob("*.ipynb")):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception:  # noqa: BLE001 — not a notebook JupyterLab could open either
            continue
        if nb.metadata.get("kernelspec", {}).get("name", "python3") != "python3" or all(
                nb.metadata.get(key) == value for key, value in want.items()):
            continue
        nb.metadata.update(want)
        try:
            replace_file(path, (nbformat.writes(nb) + "\n").encode())
        except OSError:
            continue
        changed.append(path)
    return changed


def tunnel_advice(port: int = PORT) -> str:
    """How to reach a server on this machine's loopback port from a laptop."""
    user, host = getpass.getuser(), socket.gethostname()
    return (f"No browser here: JupyterLab listens on port {port} of this machine, loopback "
            f"only. From your laptop, open a tunnel to it (with the address you log in to "
            f"this machine by, if not {host}):\n"
            f"    ssh -N -L {port}:localhost:{port} {user}@{host}\n"
            f"then open the http://127.0.0.1:{port}/lab?token=... address printed below. If "
            f"JupyterLab reports another port, use that one in both places. VS Code's "
            f"Remote-SSH forwards the port by itself.")


def main(argv: list[str] | None = None) -> None:
    """Start JupyterLab in this process's place (Ctrl-C stops it as usual)."""
    parser = argparse.ArgumentParser(prog="python -m distlab.jupyter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, nargs="?", default=Path("labs"),
                        help="the notebooks' folder (default: labs)")
    parser.add_argument("--port", type=int, default=PORT, help="default %(default)s")
    args, extra = parser.parse_known_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder: run this from the kit's top folder, "
                     f"or name the folder of the notebooks")
    write_overrides()
    match_kernel(args.folder)
    cmd = command(args.folder, args.port, *extra)
    if headless():
        print(tunnel_advice(args.port), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
