"""`lmforge plot RUN_DIR`: a PNG of train/val loss and the learning rate from ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import LMForgeError
from lmforge.train.loggers import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    train = [(r["step"], r["train/loss"]) for r in rows if isinstance(r.get("train/loss"), (int, float))]
    val = [(r["step"], r["eval/loss"]) for r in rows if isinstance(r.get("eval/loss"), (int, float))]
    lr = [(r["step"], r["train/lr"]) for r in rows if isinstance(r.get("train/lr"), (int, float))]
    out = Path(out) if out else run_dir / "loss.png"
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise LMForgeError(f"--out {out}: the image name must end in .png, .svg or .pdf")
    if not train and not val:
        raise LMForgeError(f"{run_dir / 'metrics.jsonl'} has no loss values yet; train for at least "
                           "training.log_interval steps first")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), label="val loss", color="tab:orange", marker="o", markersize=3, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lr:
        ax2 = ax.twinx()
        ax2.plot(*zip(*lr), label="learning rate", color="tab:green", alpha=0.6, linewidth=1.0)
        ax2.set_ylabel("learning rate")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
