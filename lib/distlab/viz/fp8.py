"""The figure of the GPU acceptance check ``fp8`` (:mod:`distlab.bench.fp8`): FP8's speed
against BF16's per linear shape, and each GPT's loss in both precisions."""
from __future__ import annotations


def plot_fp8(figures: dict):
    """The figures of the ``fp8`` check (``result["figures"]``), 10 inches wide (a
    notebook cell shows it at its own size, labels readable): on top FP8's speed against
    BF16's per linear shape, horizontal bars with their ratio beside them; below, each
    GPT's loss curves in both precisions over the language's loss floor, their key
    under the curves. Returns the figure, closed."""
    import matplotlib.pyplot as plt

    gpts = figures.get("gpt") or []
    linear = sorted(figures.get("linear") or [], key=lambda r: r["gflop"])
    fig = plt.figure(figsize=(10, 7.2 if gpts else 3.2))
    grid = fig.add_gridspec(2 if gpts else 1, max(len(gpts), 1),
                            height_ratios=[1, 1.25] if gpts else [1])
    left = fig.add_subplot(grid[0, :])
    speed = [r["speedup"] for r in linear]
    y = range(len(linear))
    left.barh(y, speed, color=["tab:green" if s >= 1 else "tab:blue" for s in speed])
    left.axvline(1.0, color="black", lw=1.2, zorder=1)
    left.set_yticks(y, ["×".join(map(str, r["shape"])) for r in linear])
    left.invert_yaxis()                       # smallest shape on top
    for i, s in enumerate(speed):
        left.text(s + 0.02, i, f"{s:.2f}×", va="center", fontsize=10, zorder=3,
                  bbox=dict(facecolor="white", edgecolor="none", pad=1))
    left.set_xlim(0, max([*speed, 1.0]) * 1.2)
    left.set_xlabel("FP8 speed / BF16 speed (1 = as fast)")
    left.set_title("a linear layer's forward + backward, per shape (tokens × in × out)",
                   fontsize=11)
    for k, row in enumerate(gpts):
        ax = fig.add_subplot(grid[1, k])
        for precision, style, colour in (("bf16", "-", "tab:blue"), ("fp8", "--", "tab:orange")):
            ax.plot(row[precision]["losses"], style, color=colour, label=precision.upper(),
                    lw=1.5)
        ax.axhline(row["loss_floor"], color="black", lw=1.5, ls=":",
                   label=f"loss floor ({row['loss_floor']:.2f})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.set_title(f"GPT {row['config']}: FP8 at {row['speedup']:.2f}× BF16's tokens/s",
                     fontsize=11)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=10,
                  frameon=False)
        ax.grid(alpha=0.3)
    for ax in fig.axes:
        ax.tick_params(labelsize=10)
        ax.xaxis.label.set_fontsize(10)
        ax.yaxis.label.set_fontsize(10)
    fig.tight_layout()
    plt.close(fig)
    return fig


__all__ = ["plot_fp8"]
