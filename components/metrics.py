"""Training metrics: metrics.jsonl, a tqdm progress bar, optional TensorBoard / W&B, and loss.png at the end.

Only the main rank writes anything; on other ranks MetricLogger is a no-op so recipes can call it everywhere.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .checkpoint.atomic import atomic_write_bytes
from .errors import RecipeError

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"
# Config keys whose values must never reach W&B (or any log).
_SECRET_WORDS = ("token", "key", "secret", "password", "credential")


class NonFiniteLossError(RecipeError):
    """The training loss became nan/inf; the message names the step, the last good checkpoint and what to try."""


def check_finite(
    loss: torch.Tensor | float, step: int, last_checkpoint: str | os.PathLike | None = None
) -> None:
    """Raise NonFiniteLossError if `loss` is nan or inf (syncs with the device when given a CUDA tensor)."""
    value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
    if math.isfinite(value):
        return
    where = (
        f"the last good checkpoint is {last_checkpoint} (resume: true continues from it)"
        if last_checkpoint is not None
        else "no checkpoint was saved yet"
    )
    raise NonFiniteLossError(
        f"loss became {value} at step {step}; {where}; lower the learning rate (optimizer.lr), add warmup "
        "(lr_scheduler.warmup_steps) or gradient clipping (max_grad_norm), or use dtype=fp32"
    )


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach().float().item() if v.numel() == 1 else v.detach().float().tolist()
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        v = v.item()  # numpy scalars
    return v


def redact(cfg: Any) -> Any:
    """A copy of a (nested) config with values of secret-looking keys (token, key, password...) replaced."""
    if isinstance(cfg, dict):
        return {
            k: "<redacted>" if any(w in str(k).lower() for w in _SECRET_WORDS) else redact(v)
            for k, v in cfg.items()
        }
    if isinstance(cfg, (list, tuple)):
        return [redact(v) for v in cfg]
    return cfg


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of `output_dir/metrics.jsonl` (a torn last line from a crash is skipped)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricLogger:
    """Appends one JSON line per `log(step, ...)` to metrics.jsonl and shows progress; see module docstring.

    `start_step`: the step training resumes from (0 for a fresh run). Records with a step above it are
    dropped from an existing metrics.jsonl, so a resumed run does not duplicate the steps it re-runs.
    `wandb`: keyword arguments for `wandb.init` (project, name, entity, ...); the API key comes from the
    environment / `wandb login`, never from the config. `run_config` is logged to W&B with secrets redacted.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        total_steps: int,
        is_main: bool = True,
        tensorboard: bool = False,
        wandb: dict[str, Any] | None = None,
        start_step: int = 0,
        run_config: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.total_steps = int(total_steps)
        self.is_main = is_main
        self._file = None
        self._bar = None
        self._tb = None
        self._wandb = None
        if not is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._tb_writer_cls = _import_tensorboard() if tensorboard else None
        wandb_mod = None
        if wandb is not None:
            kwargs = {str(k): v for k, v in dict(wandb).items()}
            check_no_wandb_secret(kwargs)
            wandb_mod = _import_wandb()

        path = self.output_dir / METRICS_FILE
        kept = [r for r in read_metrics(self.output_dir) if int(r.get("step", 0)) <= start_step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        atomic_write_bytes(path, text.encode())
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

        if self._tb_writer_cls is not None:
            self._tb = self._tb_writer_cls(
                log_dir=str(self.output_dir / "tensorboard"), purge_step=start_step + 1
            )
        if wandb_mod is not None:
            kwargs.setdefault("dir", str(self.output_dir))
            if run_config is not None:
                kwargs.setdefault("config", redact(run_config))
            kwargs.setdefault("resume", "allow")
            self._wandb = wandb_mod.init(**kwargs)
        if progress:
            self._bar = tqdm(total=self.total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, **metrics: Any) -> None:
        """Record metrics of `step` (e.g. loss, lr, tokens_per_s, peak_memory_gib); flushed immediately."""
        if not self.is_main:
            return
        record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
        assert self._file is not None, "MetricLogger.log after close()"
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, global_step=step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._bar is not None:
            post = {}
            for k, v in numeric.items():
                if "loss" in k:
                    post[k] = f"{v:.4f}"
            if "lr" in numeric:
                post["lr"] = f"{numeric['lr']:.2e}"
            if "on_policy_rkl" in numeric:  # KD on-policy steps (components/on_policy.py)
                post["rkl"] = f"{numeric['on_policy_rkl']:.4f}"
            if numeric.get("sampling_share"):
                post["sampling"] = f"{numeric['sampling_share']:.0%}"
            if "tokens_per_s" in numeric:
                post["tok/s"] = f"{numeric['tokens_per_s']:.0f}"
            if "peak_memory_gib" in numeric:
                post["mem"] = f"{numeric['peak_memory_gib']:.1f}GiB"
            # the postfix first: update() draws the bar, which must show this step's values, not the last one's
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(max(0, step - self._bar.n))

    def close(self) -> None:
        """Close files/bars/writers and draw `loss.png` from everything in metrics.jsonl."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        plot_losses(self.output_dir)

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_losses(output_dir: str | os.PathLike) -> Path | None:
    """Write `output_dir/loss.png`: every metric whose name contains "loss", over steps. None if no losses."""
    records = read_metrics(output_dir)
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if "loss" in k and isinstance(v, (int, float)) and k not in keys:
                keys.append(k)
    if not keys:
        return None
    # The object-oriented API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for k in keys:
        pts = [
            (r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=k, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out = Path(output_dir) / LOSS_PLOT
    atomic_write_bytes(out, buf.getvalue())
    return out


def check_no_wandb_secret(wandb: Any) -> None:
    """A `wandb:` section must not carry a key or token: the config's values go into run.json and the resume log."""
    secret = [str(k) for k in dict(wandb) if any(w in str(k).lower() for w in _SECRET_WORDS)]
    if secret:
        raise RecipeError(f"wandb.{secret[0]} must not be in the config (it would be written to run.json): set "
                          "WANDB_API_KEY or run `wandb login`")


def check_logger_packages(tensorboard: bool, wandb: Any) -> None:
    """A `wandb:` section without secrets, and the packages `tensorboard: true` and a `wandb:` section need, checked
    before anything loads or is written (finding a module does not import it); the same one-line errors as when the
    logger is created."""
    import importlib.util

    if wandb is not None:
        check_no_wandb_secret(wandb)
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise RecipeError(_NO_TENSORBOARD)
    if wandb is not None and importlib.util.find_spec("wandb") is None:
        raise RecipeError(_NO_WANDB)


_NO_TENSORBOARD = ("tensorboard=true but the `tensorboard` package is not installed: pip install tensorboard "
                   "(or set tensorboard: false)")
_NO_WANDB = ("wandb is configured but the `wandb` package is not installed: pip install wandb "
             "(or remove the wandb section)")


def _import_tensorboard() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RecipeError(_NO_TENSORBOARD) from e
    return SummaryWriter


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise RecipeError(_NO_WANDB) from e
    return wandb
