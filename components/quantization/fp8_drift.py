"""How far an fp8 teacher would drift from the run-dtype one, measured before it is quantized, and which of its
projections stay in the run dtype so the drift stays under `teacher.max_drift` (issue 19).

torchao's rowwise fp8 recipe (e4m3 inputs with one scale per token, e4m3 weights with one scale per output row,
fp32 accumulation, one rounding to the run dtype) is emulated with the same e4m3 values and scales (bit-exact)
and an fp32 matmul of them (exact products: only the accumulation order differs from the fp8 kernel's). It runs
on any device, so the choice is made (and tested) where the fp8 kernels do not exist.

The error is e4m3's 3-bit mantissa spread over every projection, so the ladder keeps whole kinds of projections,
cheapest loss of speed first: every linear in fp8, then all but the MLP's down projection, then the attention
projections only (the MLP, about 80% of a Llama teacher's linear FLOPs, in the run dtype), then nothing (the
teacher stays in the run dtype). Each rung is one eager forward over the calibration rows.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .schemes import linear_filter

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

# tried in order: (what the log calls it, projections kept in the run dtype, as names inside a decoder layer)
LADDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("every linear in fp8", ()),
    # the down projection reads the widest, most outlier-prone activations (SmolLM2: 0.035 -> 0.021 without it)
    ("every linear but the MLP's down projection in fp8", ("mlp.w2",)),
    ("attention in fp8, the MLP in the run dtype", ("mlp.",)),
)
# calibration: packed rows of the embedded transfer passages (the data KD trains on), tokenized by the teacher
# The drift depends on the context the teacher sees (SmolLM2, H200, attention-only fp8 on the first passages:
# 0.0107 nats/token in 512-token rows, 0.0091 in 1024-token rows), so calibration rows are the run's length.
# ~32k token slots spread over all the passages (passages differ: the 32 spread 1024-token rows give 0.0110
# where the first 256 give 0.0091); 64 x 512 first rows estimate the first 256 within 1% (0.0106 vs 0.0107).
CALIBRATION_TOKENS = 32768
CALIBRATION_BATCH_TOKENS = 4096  # per eager forward: attention materialises its scores (2 x 2048 rows: ~1 GiB, 8B)
VERSION = 3  # of the ladder, calibration (3: first-fit packed rows) and emulation: a cached decision of another
#   version is measured again


def e4m3_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` rounded as torchao's rowwise fp8 does: its e4m3 values (in x's dtype, where each is exact) and the fp32
    scales, one amax / 448 per row along `dim`; `values * scales` is the dequantized tensor. Bit-exact with
    torchao's Float8Tensor (tests/test_fp8_drift.py)."""
    # as torchao's _choose_scale_float8: amax / 448 in x's dtype (bf16 rounds the scale), then fp32
    scale = (x.abs().amax(dim=dim, keepdim=True) / E4M3_MAX).float().clamp_min(1e-12)
    values = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.to(x.dtype), scale


class EmulatedFp8Linear(nn.Module):
    """A frozen linear computed as the fp8 teacher's: e4m3 input rows and weight rows, scales applied to the
    product in fp32, the result in the input dtype. Wraps (does not copy) the original module."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # e4m3 values (4 significant bits) multiply exactly in fp32 and in TF32 (`emulated_fp8` allows it), accumulate in fp32 and are scaled before the one rounding to x's dtype, as the fp8 kernel does
        xq, sx = e4m3_rows(x, -1)
        wq, sw = e4m3_rows(self.linear.weight, 1)
        y = (F.linear(xq.float(), wq.float()) * sx * sw.view(-1)).to(x.dtype)
        return y if self.linear.bias is None else y + self.linear.bias


def fp8_filter(keep: tuple[str, ...]):
    """torchao `filter_fn` for the teacher's fp8 linears: the decoder layers' linears, but none whose name inside
    its layer starts with one of `keep` (e.g. `mlp.`)."""
    linears = linear_filter(include_output=False)

    def use_fp8(module: nn.Module, fqn: str) -> bool:
        return linears(module, fqn) and not _in_layer(fqn).startswith(keep or ("\0",))

    return use_fp8


def _in_layer(fqn: str) -> str:
    # "layers.3.mlp.w1" -> "mlp.w1"
    return fqn.split(".", 2)[2] if fqn.startswith("layers.") and fqn.count(".") >= 2 else fqn


@contextmanager
def emulated_fp8(model: nn.Module, keep: tuple[str, ...]) -> Iterator[int]:
    """Within the block, the linears `fp8_filter(keep)` selects compute as fp8 ones (EmulatedFp8Linear, with TF32
    fp32 matmuls); the model is restored on exit. Yields how many were swapped."""
    use = fp8_filter(keep)
    swapped = [(fqn, m) for fqn, m in model.named_modules() if use(m, fqn)]
    try:
        for fqn, m in swapped:
            parent, _, attr = fqn.rpartition(".")
            setattr(model.get_submodule(parent), attr, EmulatedFp8Linear(m))
        with _tf32_matmuls():
            yield len(swapped)
    finally:
        for fqn, m in swapped:
            parent, _, attr = fqn.rpartition(".")
            setattr(model.get_submodule(parent), attr, m)


def calibration_batches(model_dir: str | Path, device: torch.device, max_seq_len: int) -> list[dict]:
    """CALIBRATION_TOKENS token slots of the embedded transfer passages packed into rows of the run's `max_seq_len`,
    the rows spread evenly over the whole set (passages differ in how far fp8 moves them), tokenized with the
    teacher's tokenizer, on `device` as the training loop moves them, CALIBRATION_BATCH_TOKENS per micro-batch."""
    from ..data.dataset import build_dataset
    from ..models.tokenizer import Tokenizer
    from ..training import to_device

    data = build_dataset(Tokenizer.from_dir(model_dir), source="transfer:passages", format="text",
                         max_seq_len=max_seq_len, packed=True, use_chat_template=False, limit=None, shuffle=False)
    rows = max(1, min(CALIBRATION_TOKENS // max_seq_len, len(data)))
    per_batch = max(1, CALIBRATION_BATCH_TOKENS // max_seq_len)
    picked = [i * (len(data) - 1) // max(rows - 1, 1) for i in range(rows)]
    return [to_device(data.collate([data[i] for i in picked[k:k + per_batch]]), device)
            for k in range(0, rows, per_batch)]


@dataclass
class Fp8Choice:
    """What `choose_fp8_projections` decided: the projections kept in the run dtype (None: no fp8 at all) and the
    drift measured for each rung tried."""

    keep: tuple[str, ...] | None
    bound: float
    tokens: int
    seconds: float
    tried: list[tuple[str, float]] = field(default_factory=list)
    cached: str | None = None  # the file an earlier run's decision was read from (None: measured now)

    def message(self) -> str:
        """One log line: the drift of each rung tried against the bound, and what the teacher runs in."""
        drifts = "; ".join(f"{name}: {kl:.4f}" for name, kl in self.tried)
        if self.keep is None:
            verdict = ("the teacher stays in the run dtype (raise teacher.max_drift, or set it to null, to accept "
                       "fp8's drift for its speed)")
        else:
            verdict = f"using {self.tried[-1][0]}"
        when = f"measured in {self.seconds:.1f} s" if self.cached is None else f"an earlier run's: {self.cached}"
        return (f"teacher.quantize=fp8: drift KL(teacher || fp8 teacher) in nats/token on {self.tokens:,} "
                f"calibration tokens, bound teacher.max_drift={self.bound:g}: {drifts}: {verdict} ({when})")


def choose_fp8_projections(model: nn.Module, batches: list[dict], max_drift: float) -> Fp8Choice:
    """Walk LADDER until a rung's emulated drift (mean per-token KL of the model's own distribution to the fp8
    one, over `batches`' target tokens) is below `max_drift`. The model runs eagerly (compiled layers included:
    nothing is compiled for this) and is left as it was."""
    from ..training import IGNORE_INDEX, hidden_states

    start = time.perf_counter()
    choice = Fp8Choice(keep=None, bound=max_drift, tokens=0, seconds=0.0)
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        # eager flex attention on purpose: its scores fit (CALIBRATION_BATCH_TOKENS); torch's warning that it is
        # unfused told a user of a real Qwen/Llama run nothing they could act on
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
        targets = [b["labels"].to(b["tokens"].device) != IGNORE_INDEX for b in batches]
        references = [hidden_states(model, b)[t] for b, t in zip(batches, targets)]
        choice.tokens = sum(int(t.sum()) for t in targets)
        for name, keep in LADDER:
            with emulated_fp8(model, keep):
                total = sum(_kl_sum(ref, hidden_states(model, b)[t], model.output)
                            for ref, b, t in zip(references, batches, targets))
            choice.tried.append((name, float(total) / max(choice.tokens, 1)))
            if choice.tried[-1][1] < max_drift:
                choice.keep = keep
                break
    choice.seconds = time.perf_counter() - start
    return choice


@contextmanager
def _tf32_matmuls() -> Iterator[None]:
    # TF32 keeps 10 significand bits: the emulated e4m3 products are exact in it, and an 8B teacher's fp32 matmuls
    # take seconds instead of tens of seconds. The process's setting is restored on exit.
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _kl_sum(reference: torch.Tensor, hidden: torch.Tensor, head: nn.Module, chunk: int = 256) -> torch.Tensor:
    # sum over rows of KL(softmax(head(reference)) || softmax(head(hidden))), a few rows of logits at a time
    from ..losses.checkpointed import project

    total = torch.zeros((), device=reference.device)
    for i in range(0, reference.shape[0], chunk):
        p = F.log_softmax(project(head, reference[i:i + chunk], None).float(), -1)
        q = F.log_softmax(project(head, hidden[i:i + chunk], None).float(), -1)
        total += (p.exp() * (p - q)).sum()
    return total


def decision_file(model_dir: str | Path, dtype: torch.dtype, max_drift: float, max_seq_len: int) -> Path:
    """Where the decision for this teacher (its sampled fingerprint), run dtype, bound and row length is kept
    between runs, under recipe's cache (`$RECIPE_CACHE`): a second run skips the measurement (seconds of its
    first step; 16.5 s for an 8B teacher in 2048-token rows on an H200)."""
    from ..assets import cache_dir
    from ..logits_cache.manifest import teacher_fingerprint

    name = (f"{teacher_fingerprint(model_dir)[:32]}-{str(dtype).removeprefix('torch.')}-{max_drift:g}-"
            f"{max_seq_len}-v{VERSION}.json")
    return cache_dir() / "fp8_drift" / name


def load_decision(path: Path) -> Fp8Choice | None:
    """An earlier run's decision, or None (absent or unreadable: measure again)."""
    try:
        d = json.loads(path.read_text())
        keep = None if d["keep"] is None else tuple(d["keep"])
        return Fp8Choice(keep=keep, bound=d["bound"], tokens=d["tokens"], seconds=d["seconds"],
                         tried=[(n, float(kl)) for n, kl in d["tried"]], cached=str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_decision(path: Path, choice: Fp8Choice) -> None:
    """Keep the decision for the next run (atomically; a cache that cannot be written is skipped, not an error)."""
    from ..checkpoint.atomic import atomic_write_bytes

    try:
        atomic_write_bytes(path, json.dumps({**asdict(choice), "cached": None}).encode(), output=False)
    except OSError:
        pass
