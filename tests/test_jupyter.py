"""``make lab``: JupyterLab starts as an unprivileged user (tests/test_browser.py starts it
with ``make lab`` as whoever runs the tests, root in CI), says how to reach it from a
laptop where no browser can open, and keeps JupyterLab's news pop-up away."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

import browser_support
from distlab import jupyter
from distlab.runtime import privileges

pytestmark = pytest.mark.skipif(
    not shutil.which("jupyter", path=str(Path(sys.executable).parent)),
    reason=f"jupyter is not installed beside {sys.executable}")


def _served(server: browser_support.JupyterLab) -> list[str]:
    """The notebooks the running server lists at its top level."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/api/contents",
                                     headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return sorted(item["name"] for item in json.load(reply)["content"]
                      if item["name"].endswith(".ipynb"))


def _make_lab(root: Path, user=None) -> None:
    """``make lab`` on a copy of labs/ (it gives the labs this kernel's metadata)."""
    labs = sorted((browser_support.REPO / "labs").glob("*.ipynb"))
    with browser_support.JupyterLab(labs, root, root / "jupyterlab.log", make_lab=True,
                                    user=user) as server:
        assert _served(server) == [p.name for p in labs]
    if jupyter.headless():  # a server with no display: the way in from a laptop
        assert f"ssh -N -L {server.port}:localhost:{server.port}" in (
            root / "jupyterlab.log").read_text()


def test_make_lab_starts_jupyterlab_as_an_unprivileged_user():
    if os.geteuid() != 0:
        pytest.skip("the test runs as an unprivileged user already: the test above covers it")
    user, why = privileges.unprivileged_user()
    if not user:
        pytest.skip(f"no unprivileged user to switch to: {why}")
    uid, gid = map(int, user.split(":"))
    for path in (browser_support.REPO / "Makefile", Path(sys.executable).resolve()):
        if subprocess.run(["test", "-r", str(path)], user=uid, group=gid, extra_groups=[],
                          check=False).returncode:
            pytest.skip(f"{path} is out of uid {uid}'s reach here: a user's own checkout "
                        f"and Python are tried by hand (docs/measurements.md)")
    root = Path(tempfile.mkdtemp(prefix="distlab-lab-"))  # /tmp: reachable by that user
    try:
        _make_lab(root, user=(uid, gid))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("euid", [0, 1000])
def test_allow_root_is_passed_for_root_only(monkeypatch, euid):
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    assert ("--allow-root" in jupyter.command(Path("labs"))) == (euid == 0)


def test_with_no_display_it_opens_no_browser_and_says_how_to_tunnel(monkeypatch):
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.2 50000 10.0.0.1 22")
    cmd = jupyter.command(Path("labs"), 8890)
    assert "--ServerApp.open_browser=False" in cmd and "--ServerApp.ip=127.0.0.1" in cmd
    advice = jupyter.tunnel_advice(8890)
    assert "ssh -N -L 8890:localhost:8890" in advice and "token" in advice


def test_with_a_display_and_no_ssh_it_opens_the_browser(monkeypatch):
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    assert "--ServerApp.open_browser=False" not in jupyter.command(Path("labs"))


def test_overrides_turn_the_news_off_and_keep_what_was_there(tmp_path):
    path = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "dark"},
                                "@jupyterlab/apputils-extension:notification": {"x": 1}}))
    assert jupyter.write_overrides(tmp_path) == path
    settings = json.loads(path.read_text())
    assert settings["@jupyterlab/apputils-extension:themes"] == {"theme": "dark"}
    assert settings["@jupyterlab/apputils-extension:notification"] == {
        "x": 1, "fetchNews": "false", "checkForUpdates": False}


def test_labs_get_this_kernels_metadata_and_nothing_else_changes(tmp_path):
    """JupyterLab rewrites a notebook's kernelspec and language_info on opening it (the
    notebook then shows as modified): make lab gives the labs this environment's first."""
    import nbformat

    lab = browser_support.REPO / "labs" / "00_setup.ipynb"
    nb = nbformat.read(lab, as_version=4)
    nb.metadata["language_info"] = {**nb.metadata.get("language_info", {}), "version": "3.0.1"}
    nb.cells[1].source += "\n# the student's edit"
    nbformat.write(nb, tmp_path / "mine.ipynb")
    other = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "julia-1.10", "display_name": "Julia 1.10", "language": "julia"}})
    nbformat.write(other, tmp_path / "julia.ipynb")
    (tmp_path / "link.ipynb").symlink_to(tmp_path / "mine.ipynb")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.ipynb")}

    assert jupyter.match_kernel(tmp_path) == [tmp_path / "mine.ipynb"]
    mine = nbformat.read(tmp_path / "mine.ipynb", as_version=4)
    assert {k: mine.metadata[k] for k in ("kernelspec", "language_info")} == \
        jupyter.kernel_metadata()
    assert mine.cells == nb.cells  # the student's edit kept
    assert (tmp_path / "julia.ipynb").read_bytes() == before["julia.ipynb"]
    assert jupyter.match_kernel(tmp_path) == []  # once is enough
