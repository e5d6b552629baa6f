"""plots/*.png of a run: each metric against the optimizer step, resumes marked with a dashed line."""

from __future__ import annotations

from pathlib import Path

from disttrain.metrics.log import read_metrics

PLOTS_DIR = "plots"
# (file, title, [(metric, label)]); a panel is drawn when the run logged any of its metrics
PANELS = (
    ("loss", "loss", (("loss", "train"), ("eval_loss", "eval"))),
    ("lr", "learning rate", (("lr", "lr"),)),
    ("grad_norm", "gradient norm (before clipping)", (("grad_norm", "grad norm"),)),
    ("tokens_per_s", "tokens/s per device", (("tokens_per_s_per_device", "tokens/s/device"),)),
    ("mfu", "MFU", (("mfu", "MFU"),)),
    ("rewards", "preference rewards", (("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"),
                                       ("rewards/margin", "margin"))),
    ("reward_accuracy", "reward accuracy", (("rewards/accuracy", "train"), ("eval_rewards/accuracy", "eval"))),
    ("rl_reward", "online RL reward", (("reward", "mean"), ("reward_std", "std"))),
    ("rl_completions", "completion length (tokens)", (("completions/mean_length", "mean"),
                                                      ("completions/max_length", "max"))),
    ("rl_kl_entropy", "KL to the reference, entropy", (("kl", "KL"), ("entropy", "entropy"))),
)


def _draw(ax, records: list[dict], series, title: str, resumes: list[int]) -> bool:
    drawn = False
    for key, label in series:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
            drawn = True
    for step in resumes:
        ax.axvline(step, color="grey", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if drawn and len(series) > 1:
        ax.legend()
    return drawn


def plot_run(run_dir: str | Path) -> list[Path]:
    """One PNG per panel with data plus overview.png (all panels); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    records = read_metrics(run)
    resumes = [r["resumed_from_step"] for r in records if "resumed_from_step" in r]
    out = run / PLOTS_DIR
    out.mkdir(exist_ok=True)
    panels = [p for p in PANELS if any(isinstance(r.get(key), (int, float)) for r in records for key, _ in p[2])]
    written = []
    for name, title, series in panels:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        _draw(ax, records, series, title, resumes)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out / f"{name}.png")
    if panels:
        cols = 2
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False)
        for ax, (name, title, series) in zip(axes.flat, panels):
            _draw(ax, records, series, title, resumes)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        resumed = f" (resumed at step {', '.join(map(str, resumes))}: dashed)" if resumes else ""
        fig.suptitle("/".join(run.parts[-2:]) + resumed)
        fig.tight_layout()
        fig.savefig(out / "overview.png", dpi=100)
        plt.close(fig)
        written.append(out / "overview.png")
    return written
