"""Knowledge-distillation divergences over logits chunks, summed over valid (non-ignored) tokens.

Every loss takes ``student_logits [n, v]``, ``teacher_logits [n, v]`` and ``labels [n]`` and returns the SUM over
rows whose label is not ``ignore_index`` of a per-token divergence between the temperature-softened teacher and
student distributions, multiplied by ``T**2`` (Hinton et al. 2015), so callers can divide by a global token count.
Math runs in (at least) fp32 and tolerates ``-inf`` logits (masked vocabulary entries) without producing NaN.

We write these few lines ourselves (instead of torchtune's KD losses) because torchtune's ``ForwardKLLoss`` is a
cross-entropy (teacher entropy not subtracted), returns a mean rather than a sum, and has no JSD/skew variants.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from llm_recipe.components.errors import RecipeError, read_utf8

# Same value as llm_recipe.components.data.IGNORE_INDEX (the contract's home for it); repeated here so that the losses do not
# depend on the data package.
IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "KD_LOSSES",
    "JSD",
    "ForwardKL",
    "KDLoss",
    "ReverseKL",
    "SkewForwardKL",
    "SkewReverseKL",
    "SymmetricKL",
    "build_kd_loss",
    "forward_kl",
    "jsd",
    "reverse_kl",
    "same_tokenizer",
    "shared_vocab",
    "skew_kl",
    "skew_reverse_kl",
    "symmetric_kl",
]


# ----------------------------------------------------------------------------------------------------------------
# Numerically safe building blocks (all operate on log-probabilities along the last dim)
# ----------------------------------------------------------------------------------------------------------------


def _compute_dtype(t: Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 stays fp64 (tests use fp64 for exact comparisons)."""
    return torch.promote_types(t.dtype, torch.float32)


def _kl_rows(logp: Tensor, logq: Tensor) -> Tensor:
    """Per-row KL(p || q) = sum_v p (log p - log q) from log-probabilities, 0*log0 := 0 without NaN (value or grad).

    Entries with p == 0 are replaced by 0 *before* the product (a ``torch.where`` after the product would still
    send 0 * inf = NaN into the backward pass).
    """
    p = logp.exp()
    support = p > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp_s = torch.where(support, logp, zero)
    logq_s = torch.where(support, logq, zero)
    return (p * (logp_s - logq_s)).sum(-1)


def _log_mixture(logp: Tensor, logq: Tensor, weight_p: float) -> Tensor:
    """log(w * p + (1 - w) * q) via logsumexp, with w in [0, 1]; entries where p = q = 0 stay -inf-free in backward.

    Where both inputs are -inf, logsumexp's backward would compute exp(-inf - -inf) = NaN; those entries are replaced
    by 0 before the logsumexp and set back to -inf afterwards (they carry no probability mass, so no gradient).
    """
    if weight_p == 0.0:
        return logq
    if weight_p == 1.0:
        return logp
    both_empty = torch.isneginf(logp) & torch.isneginf(logq)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    a = torch.where(both_empty, zero, logp + math.log(weight_p))
    b = torch.where(both_empty, zero, logq + math.log1p(-weight_p))
    mix = torch.logsumexp(torch.stack([a, b]), dim=0)
    return torch.where(both_empty, torch.full_like(mix, -math.inf), mix)


def _prepare(
    student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Validate shapes, keep rows with a valid label, and return (student, teacher) log-probs at temperature T."""
    if student_logits.dim() != 2 or teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"KD losses expect student and teacher logits of the same shape [n, v]; got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)} (slice both to the shared vocab first)"
        )
    if labels.shape != student_logits.shape[:1]:
        raise ValueError(f"labels must have shape [{student_logits.shape[0]}], got {tuple(labels.shape)}")
    valid = labels != ignore_index
    dtype = _compute_dtype(student_logits)
    s = student_logits[valid].to(dtype) / temperature
    t = teacher_logits[valid].to(dtype) / temperature
    return F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise RecipeError(f"kd temperature must be a positive number, got {temperature!r}")


def _check_unit(name: str, value: float, *, lo_open: bool, hi_open: bool, hint: str = "") -> None:
    ok = isinstance(value, (int, float)) and (0.0 < value if lo_open else 0.0 <= value)
    ok = ok and (value < 1.0 if hi_open else value <= 1.0)
    if not ok:
        lo, hi = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise RecipeError(f"kd {name} must be in {lo}0, 1{hi}, got {value!r}{hint}")


# ----------------------------------------------------------------------------------------------------------------
# Functional forms
# ----------------------------------------------------------------------------------------------------------------


def forward_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum over valid tokens of the true forward KL(p_T || p_S) * T^2 (0 when student equals teacher)."""
    _check_temperature(temperature)
    log_s, log_t = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _kl_rows(log_t, log_s).sum() * temperature**2


def reverse_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum over valid tokens of the reverse KL(p_S || p_T) * T^2 (mode-seeking)."""
    _check_temperature(temperature)
    log_s, log_t = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _kl_rows(log_s, log_t).sum() * temperature**2


def symmetric_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    ratio: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum over valid tokens of (ratio * KL(p_T||p_S) + (1 - ratio) * KL(p_S||p_T)) * T^2."""
    _check_temperature(temperature)
    _check_unit("symmetric_kl ratio", ratio, lo_open=False, hi_open=False)
    log_s, log_t = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    per_token = ratio * _kl_rows(log_t, log_s) + (1.0 - ratio) * _kl_rows(log_s, log_t)
    return per_token.sum() * temperature**2


def jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    beta: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum over valid tokens of the generalized JSD * T^2, with M = beta*p_T + (1-beta)*p_S.

    JSD_beta = beta * KL(p_T || M) + (1 - beta) * KL(p_S || M), the same formula as TRL's GKD for 0 < beta < 1.
    beta = 0 or 1 makes it identically 0 and is refused (use forward_kl / reverse_kl, which TRL substitutes there).
    """
    _check_temperature(temperature)
    _check_unit(
        "jsd beta",
        beta,
        lo_open=True,
        hi_open=True,
        hint=" (JSD is identically 0 at 0 and 1; use kind=forward_kl for TRL's beta=0, kind=reverse_kl for beta=1)",
    )
    log_s, log_t = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    log_m = _log_mixture(log_t, log_s, beta)
    per_token = beta * _kl_rows(log_t, log_m) + (1.0 - beta) * _kl_rows(log_s, log_m)
    return per_token.sum() * temperature**2


def skew_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    alpha: float = 0.1,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum over valid tokens of DistiLLM's skew forward KL(p_T || alpha*p_T + (1-alpha)*p_S) * T^2.

    alpha = 0 is the plain forward KL; alpha must be < 1 (at 1 the divergence is identically 0).
    """
    _check_temperature(temperature)
    _check_unit("skew_kl alpha", alpha, lo_open=False, hi_open=True)
    log_s, log_t = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _kl_rows(log_t, _log_mixture(log_t, log_s, alpha)).sum() * temperature**2


def skew_reverse_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    alpha: float = 0.1,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum over valid tokens of DistiLLM's skew reverse KL(p_S || alpha*p_S + (1-alpha)*p_T) * T^2."""
    _check_temperature(temperature)
    _check_unit("skew_reverse_kl alpha", alpha, lo_open=False, hi_open=True)
    log_s, log_t = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _kl_rows(log_s, _log_mixture(log_s, log_t, alpha)).sum() * temperature**2


# ----------------------------------------------------------------------------------------------------------------
# Callable objects (what chunked_kd_and_ce and configs use)
# ----------------------------------------------------------------------------------------------------------------


class KDLoss:
    """A KD divergence with its hyper-parameters bound; ``loss(student_logits, teacher_logits, labels) -> sum``."""

    kind: str = ""

    def __init__(self, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX) -> None:
        _check_temperature(temperature)
        self.temperature = float(temperature)
        self.ignore_index = ignore_index

    def _extra(self) -> dict[str, float]:
        return {}

    def __call__(self, student_logits: Tensor, teacher_logits: Tensor, labels: Tensor) -> Tensor:
        fn = _FUNCTIONS[self.kind]
        return fn(
            student_logits,
            teacher_logits,
            labels,
            temperature=self.temperature,
            ignore_index=self.ignore_index,
            **self._extra(),
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in {"temperature": self.temperature, **self._extra()}.items())
        return f"{type(self).__name__}({args})"


class ForwardKL(KDLoss):
    """True forward KL(p_T || p_S): mass-covering, the classic Hinton et al. objective minus teacher entropy."""

    kind = "forward_kl"


class ReverseKL(KDLoss):
    """Reverse KL(p_S || p_T): mode-seeking (MiniLLM, GKD with beta=1)."""

    kind = "reverse_kl"


class SymmetricKL(KDLoss):
    """ratio * forward KL + (1 - ratio) * reverse KL."""

    kind = "symmetric_kl"

    def __init__(
        self, temperature: float = 1.0, ratio: float = 0.5, ignore_index: int = IGNORE_INDEX
    ) -> None:
        super().__init__(temperature, ignore_index)
        _check_unit("symmetric_kl ratio", ratio, lo_open=False, hi_open=False)
        self.ratio = float(ratio)

    def _extra(self) -> dict[str, float]:
        return {"ratio": self.ratio}


class JSD(KDLoss):
    """Generalized Jensen-Shannon divergence (GKD), beta in (0, 1) weights the teacher in the mixture."""

    kind = "jsd"

    def __init__(self, temperature: float = 1.0, beta: float = 0.5, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__(temperature, ignore_index)
        _check_unit(
            "jsd beta",
            beta,
            lo_open=True,
            hi_open=True,
            hint=" (JSD is identically 0 at 0 and 1; use kind=forward_kl for TRL's beta=0, kind=reverse_kl for beta=1)",
        )
        self.beta = float(beta)

    def _extra(self) -> dict[str, float]:
        return {"beta": self.beta}


class SkewForwardKL(KDLoss):
    """DistiLLM skew forward KL(p_T || alpha p_T + (1 - alpha) p_S), alpha in [0, 1)."""

    kind = "skew_kl"

    def __init__(
        self, temperature: float = 1.0, alpha: float = 0.1, ignore_index: int = IGNORE_INDEX
    ) -> None:
        super().__init__(temperature, ignore_index)
        _check_unit(f"{self.kind} alpha", alpha, lo_open=False, hi_open=True)
        self.alpha = float(alpha)

    def _extra(self) -> dict[str, float]:
        return {"alpha": self.alpha}


class SkewReverseKL(SkewForwardKL):
    """DistiLLM skew reverse KL(p_S || alpha p_S + (1 - alpha) p_T), alpha in [0, 1)."""

    kind = "skew_reverse_kl"


_FUNCTIONS = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "symmetric_kl": symmetric_kl,
    "jsd": jsd,
    "skew_kl": skew_kl,
    "skew_reverse_kl": skew_reverse_kl,
}

KD_LOSSES: dict[str, type[KDLoss]] = {
    cls.kind: cls for cls in (ForwardKL, ReverseKL, SymmetricKL, JSD, SkewForwardKL, SkewReverseKL)
}


def build_kd_loss(kind: str, temperature: float = 1.0, **kwargs: float) -> KDLoss:
    """Build the KD loss named ``kind`` (a config string) with its hyper-parameters, failing early on bad names/keys."""
    if kind not in KD_LOSSES:
        raise RecipeError(f"unknown kd loss kind {kind!r}; valid kinds: {', '.join(KD_LOSSES)}")
    cls = KD_LOSSES[kind]
    allowed = [name for name in inspect.signature(cls).parameters if name != "temperature"]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise RecipeError(
            f"kd loss {kind!r} does not take {', '.join(unknown)}; its options are: {', '.join(allowed)}"
        )
    return cls(temperature=temperature, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary compatibility between student and teacher
# ----------------------------------------------------------------------------------------------------------------


def shared_vocab(
    student_vocab: int, teacher_vocab: int, tokenizer_vocab: int, tokenizers_match: bool = True
) -> tuple[int, str | None]:
    """Return (size to slice both logits to, message to log or None) for KD between two output heads.

    Heads often carry padding rows past the tokenizer (e.g. 151936 vs 151665); logits of padding ids are never
    targets, so both are trimmed to the tokenizer size. A head smaller than the tokenizer, or different tokenizers,
    means the token ids do not mean the same thing: that is a RecipeError raised before training starts.
    """
    if not tokenizers_match:
        raise RecipeError(
            "kd: student and teacher tokenizers differ; token-level distillation needs the same tokenizer "
            "(pick a teacher from the student's model family)"
        )
    for who, size in (("student", student_vocab), ("teacher", teacher_vocab)):
        if size < tokenizer_vocab:
            raise RecipeError(
                f"kd: {who} output vocab ({size}) is smaller than the tokenizer vocab ({tokenizer_vocab}); "
                "the student and teacher do not share a vocabulary"
            )
    if student_vocab == teacher_vocab:
        return student_vocab, None
    msg = (
        f"kd: student vocab {student_vocab} and teacher vocab {teacher_vocab} differ only by padding rows; "
        f"both logits are sliced to the tokenizer vocab {tokenizer_vocab}"
    )
    return tokenizer_vocab, msg


def same_tokenizer(student_dir: str | Path, teacher_dir: str | Path) -> bool:
    """True when two HF model folders' ``tokenizer.json`` define the same vocabulary and added tokens."""

    def fingerprint(d: str | Path) -> tuple[object, object]:
        path = Path(d) / "tokenizer.json"
        try:
            data = json.loads(read_utf8(path))
        except FileNotFoundError:
            raise RecipeError(f"kd: {path} not found; both models need a tokenizer.json") from None
        except json.JSONDecodeError as e:
            raise RecipeError(f"kd: {path} is not valid JSON ({e})") from None
        model = data.get("model", {})
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens", []))
        return model.get("vocab"), added

    return fingerprint(student_dir) == fingerprint(teacher_dir)
