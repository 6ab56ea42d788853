"""Launches from a real Jupyter kernel: notebook-defined functions, output in the cell,
and "interrupt kernel" stopping every rank."""
import os
import time

import pytest

jupyter_client = pytest.importorskip("jupyter_client")


@pytest.fixture
def kernel():
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=os.getcwd())
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _execute(kc, code, timeout=120):
    """Run ``code`` in the kernel; return (stdout text, error name or None)."""
    msg_id = kc.execute(code)
    out, error = [], None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            error = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out), error
    raise TimeoutError(code)


def _gone(pids, seconds=15):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_cell_defined_function_runs_on_ranks_and_an_interrupt_stops_them(kernel, tmp_path):
    km, kc = kernel
    out, error = _execute(kc, """
import os, time
import torch, torch.distributed as dist
from distlab import launch

def square_sum(k):
    t = torch.tensor([float(dist.get_rank() + k)]) ** 2
    dist.all_reduce(t)
    print("rank", dist.get_rank(), "done")
    return t.item()

print(launch.run(square_sum, 3, 1, backend="gloo"))
""")
    assert error is None, out
    assert "[rank 2] rank 2 done" in out and "[14.0, 14.0, 14.0]" in out

    msg_id = kc.execute(f"""
def sleeper(path):
    open(path + str(dist.get_rank()), "w").write(str(os.getpid()))
    time.sleep(600)

launch.run(sleeper, 2, {str(tmp_path / 'pid')!r}, backend="gloo", timeout=600)
""")
    deadline = time.monotonic() + 60
    files = [tmp_path / f"pid{r}" for r in range(2)]
    while time.monotonic() < deadline and not all(f.exists() and f.read_text() for f in files):
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in files]
    km.interrupt_kernel()  # what JupyterLab's "interrupt" button does
    error = None
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error = msg["content"]["ename"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert error == "KeyboardInterrupt"
    assert _gone(pids), "the ranks outlived the interrupted cell"
    out, error = _execute(kc, "print(launch.run(dist.get_world_size, 2, backend='gloo'))")
    assert error is None and "[2, 2]" in out, "the kernel launches again after an interrupt"
