"""Host cost of Python post-accumulate-grad hooks on CUDA: plain process vs a distlab rank."""
import sys, time, statistics, threading
import torch, torch.nn as nn

def measure(label, hooks, n=74, reps=20):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)]).cuda()
    handles = []
    if hooks:
        for p in net.parameters():
            handles.append(p.register_post_accumulate_grad_hook(lambda p: None))
    x = torch.randn(256, 64, device="cuda")
    ts = []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        net(x).sum().backward()
        dt = time.perf_counter() - t
        for p in net.parameters(): p.grad = None
        if i >= 3: ts.append(dt)
    torch.cuda.synchronize()
    print(f"{label:40} backward host {statistics.median(ts)*1e3:7.2f} ms  ({2*n} params, hooks={hooks})", flush=True)
    return statistics.median(ts)

def suite(where):
    print("threads:", [t.name for t in threading.enumerate()], "switchinterval", sys.getswitchinterval(), flush=True)
    a = measure(f"{where}: no hooks", False)
    b = measure(f"{where}: empty hooks", True)
    print(f"{where}: per hook {(b-a)/148*1e6:.1f} us", flush=True)
    old = sys.getswitchinterval(); sys.setswitchinterval(1e-5)
    b2 = measure(f"{where}: empty hooks, switchinterval 10us", True)
    sys.setswitchinterval(old)
    print(f"{where}: per hook {(b2-a)/148*1e6:.1f} us (switchinterval 10 us)", flush=True)
    return a, b, b2

def rank_fn():
    import torch.distributed as dist
    return suite(f"rank {dist.get_rank()}")

if __name__ == "__main__":
    suite("plain process")
    from distlab import launch
    launch.run(rank_fn, 2, backend="nccl", timeout=120)
