"""The second KD study's loss curves (bench/kd_study2.py `plot`): out/loss_curves.png from every training's
metrics.jsonl; its own module to keep the driver under 500 lines."""

from __future__ import annotations

import json
from pathlib import Path


def plot(out: Path) -> Path:
    """out/loss_curves.png: every training row's CE on the transfer data and the KD rows' divergence, smoothed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    ce_ax, kd_ax = fig.subplots(1, 2)
    for path in sorted((out / "train").glob("*/metrics.jsonl")):
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        steps = [r["step"] for r in rows]
        for ax, key in ((ce_ax, "ce_loss"), (kd_ax, "kd_loss")):
            ys = [r.get(key, r["loss"] if key == "ce_loss" else None) for r in rows]
            if any(y is None for y in ys):
                continue  # qat logs one loss (its CE)
            w = 20  # moving average over 20 steps: one step's loss is one batch's
            smooth = [sum(ys[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(ys))]
            name = path.parent.name
            untrained = key == "kd_loss" and name.startswith("sft")  # sft logs the divergence, does not train on it
            ax.plot(steps, smooth, label=name + (" (logged only)" if untrained else ""), linewidth=1.2,
                    linestyle="--" if untrained else "-")
    ce_ax.set(title="CE on the transfer data (20-step mean)", xlabel="step", ylabel="nats/token")
    kd_ax.set(title="KD loss: forward KL to the teacher (20-step mean)", xlabel="step", ylabel="nats/token")
    for ax in (ce_ax, kd_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    dest = out / "loss_curves.png"
    FigureCanvasAgg(fig).print_png(str(dest))
    return dest
