"""Where the bucketed step's host time goes at 4 x 1024 tokens (98M GPT, 2 NCCL ranks):
step time and host time per step of naive, DDP and bucketed with the tracer's status
board on or off, the comm-stream or plain-handles channel, the process group's own
allreduce (C++, no torch.distributed Python per call), one hook per bucket instead of
one per parameter ("bucketed sentinel": an upper bound on what fewer hooks could win,
with no guard, so right only for a graph that never changes), and the GC on or off.
Env: MODES (comma-separated, default all three), ROUNDS (5), SHAPES (4x1024,16x1024),
VARIANTS (comma-separated names, default all)."""
import functools, gc, os, sys
import torch, torch.distributed as dist, torch.nn.functional as F


class PgHandles:
    """Handles through the process group's C++ allreduce (what DDP's reducer calls)."""

    def __init__(self):
        self.pg = dist.group.WORLD
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = dist.ReduceOp.AVG

    def launch(self, flat):
        return self.pg.allreduce([flat], self.opts)

    def wait(self, handles):
        for h in handles:
            h.wait()


def sentinel_hooks(wrapped, step):
    """Run ``step`` once with every hook, noting the order gradients arrive in; then keep
    one hook per bucket, on its last-arriving parameter, which marks the whole bucket
    ready (no check that the others arrived: an experiment, not a design)."""
    order = []
    wrapped._on_grad = lambda i, j: (order.append((i, j)), type(wrapped)._on_grad(wrapped, i, j))
    step()
    del wrapped._on_grad
    last = dict(order)  # bucket -> its last-arriving position
    for h in wrapped._hooks:
        h.remove()

    def ready(i, _param):
        b = wrapped.buckets[i]
        if wrapped.require_sync:
            b.ready.update(range(len(b.params)))
            wrapped._launch(flush=False)
    wrapped._hooks = [wrapped.buckets[i].params[j].register_post_accumulate_grad_hook(
        functools.partial(ready, i)) for i, j in last.items()]


def rank_fn(shape, model="gpt-100m", vocab=16384):
    from distlab import backend, comm, overlap
    from distlab.model import GPT, config
    from distlab.bench import host_seconds
    rank, device = dist.get_rank(), backend.device()
    board = comm._status
    cfg = config(model, vocab_size=vocab)
    cuda = device.type == "cuda"
    batch, seq = shape
    x = torch.randint(vocab, (batch, seq + 1), device=device,
                      generator=torch.Generator(device=device).manual_seed(rank))
    variants = {"naive": ("naive", "auto"), "DDP": ("torch DDP", "auto"),
                "bucketed stream": ("bucketed", "stream"), "bucketed handles": ("bucketed", "handles"),
                "bucketed pg": ("bucketed", "handles"), "bucketed sentinel": ("bucketed", "handles")}
    if not cuda:
        del variants["bucketed stream"]
    chosen = os.environ.get("VARIANTS")
    if chosen:
        variants = {k: v for k, v in variants.items() if k in chosen.split(",")}
    steps = {}
    for name, (variant, channel) in variants.items():
        torch.manual_seed(0)
        net = GPT(cfg).to(device)
        wrapped, finish = overlap.wrap(net, variant, 25, channel=channel)
        if name == "bucketed pg":
            wrapped.channel = PgHandles()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=cuda)
        def step(wrapped=wrapped, finish=finish, opt=opt):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = wrapped(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
            finish(); opt.step(); opt.zero_grad(set_to_none=True)
        if name == "bucketed sentinel":
            sentinel_hooks(wrapped, step)
        steps[name] = step
    out = {}
    modes = os.environ.get("MODES", "traced,untraced,no gc").split(",")
    modes = [m.strip() for m in modes]
    if "no gc" in modes:
        modes[modes.index("no gc")] = "untraced, no gc"
    for mode in modes:
        comm.post_status_to(board if mode == "traced" else None)
        if "no gc" in mode:
            gc.collect(); gc.disable()
        t = overlap.compare(steps, rounds=int(os.environ.get("ROUNDS", 5)), iters=5, warmup=2)
        h = {n: host_seconds(s) for n, s in steps.items()}
        gc.enable()
        out[mode] = (t, h)
    comm.post_status_to(board)
    return out


if __name__ == "__main__":
    from distlab import launch
    cpu = len(sys.argv) > 1 and sys.argv[1] == "cpu"
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("SHAPES", "4x1024,16x1024").split(",")]
    for shape in ((2, 8),) if cpu else shapes:
        res = launch.run(rank_fn, 2, shape, *(("test", 13) if cpu else ()),
                         backend="gloo" if cpu else "nccl", timeout=400)
        for mode, (t, h) in res[0].items():
            print(f"{shape[0]}x{shape[1]} {mode:16} " + "  ".join(
                f"{n}: {1e3 * t[n]:5.1f}/{1e3 * max(r[mode][1][n] for r in res):5.1f}ms"
                for n in t) + "   bkt/DDP " + " ".join(
                f"{t[n] / t['DDP']:.3f}" for n in t if n.startswith("bucketed")), flush=True)
