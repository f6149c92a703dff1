"""The loss picture of runs (plot.py's, the run report's): train and val loss against steps and wall time, one colour
per run, in a PNG."""
from __future__ import annotations

from nanogpt import files
from nanogpt.metrics import MetricsLog
from nanogpt.optional import pyplot


def draw(runs: list[tuple[str, MetricsLog]], out: str, fix: str = files.OUT_DIR_FIX) -> str:
    """Draw (name, metrics) runs into the PNG `out`; returns `out`. `fix`: what a failed write's line says to do."""
    plt = pyplot("plot.py")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for i, (name, (steps, evals, _)) in enumerate(runs):
        color = f"C{i}"
        for ax, x in zip(axes, ("iter", "elapsed_s")):
            ax.plot([r[x] for r in steps], [r["loss"] for r in steps], color=color, lw=0.8, alpha=0.5,
                    label=f"{name} train")
            ax.plot([r[x] for r in evals], [r["val_loss"] for r in evals], color=color, lw=2, marker="o", ms=4,
                    label=f"{name} val")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall time (s)")
    axes[0].set_ylabel("loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    try:
        files.atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"), "loss picture", fix)
    finally:
        plt.close(fig)
    return out
