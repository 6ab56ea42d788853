"""Where the host's time goes in one step at 4 x 1024 tokens (98M GPT, 2 NCCL ranks), for
bucketed, torch DDP and naive: the host's time in forward (with the loss), backward,
the synchronisation call and the optimizer (no device sync inside a step, median of
20 steps), the step time, and for bucketed the time spent inside its gradient hooks
(which run on autograd's device thread, out of cProfile's sight).
Run: python3 tools/gpu/exp_profile_dp.py [cpu]"""
import statistics, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F


def rank_fn(shape, model="gpt-100m", vocab=16384, steps=20):
    from distlab import backend, dp, overlap
    from distlab.model import GPT, config
    rank, device = dist.get_rank(), backend.device()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = config(model, vocab_size=vocab)
    batch, seq = shape
    x = torch.randint(vocab, (batch, seq + 1), device=device,
                      generator=torch.Generator(device=device).manual_seed(rank))
    out = {}
    hook_time = [0.0, 0]
    original = dp._grad_ready

    def timed_hook(*args):
        t = time.perf_counter()
        original(*args)
        hook_time[0] += time.perf_counter() - t
        hook_time[1] += 1

    for variant in ("bucketed", "torch DDP", "naive", "bucketed, hooks timed"):
        torch.manual_seed(0)
        net = GPT(cfg).to(device)
        dp._grad_ready = timed_hook if variant.endswith("timed") else original
        wrapped, finish = overlap.wrap(net, variant.split(",")[0], 25)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=cuda)
        parts = {"forward": [], "backward": [], "finish": [], "optimizer": [], "step": []}

        def step(record, wrapped=wrapped, finish=finish, opt=opt):
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = wrapped(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            finish()
            t3 = time.perf_counter()
            opt.step(); opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            if record:
                for k, v in zip(("forward", "backward", "finish", "optimizer"),
                                (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    parts[k].append(v)
        for _ in range(3):
            step(False)
        sync(); dist.barrier(); sync()
        hook_time[:] = [0.0, 0]
        t = time.perf_counter()
        for _ in range(steps):
            step(True)
        sync()
        parts["step"] = [(time.perf_counter() - t) / steps]
        out[variant] = {k: statistics.median(v) for k, v in parts.items()}
        if variant.endswith("timed"):
            out[variant]["hooks"] = hook_time[0] / steps
            out[variant]["hook calls"] = hook_time[1] / steps
        del wrapped, net, opt
    dp._grad_ready = original
    return out


if __name__ == "__main__":
    from distlab import launch
    cpu = len(sys.argv) > 1 and sys.argv[1] == "cpu"
    res = launch.run(rank_fn, 2, (2, 8) if cpu else (4, 1024), *(("test", 13) if cpu else ()),
                     backend="gloo" if cpu else "nccl", timeout=300)
    for rank, r in enumerate(res):
        for variant, parts in r.items():
            print(f"rank {rank} {variant:22} " + "  ".join(
                f"{k} {v * 1e3:.2f} ms" if k != "hook calls" else f"{k} {v:.0f}"
                for k, v in parts.items()), flush=True)
