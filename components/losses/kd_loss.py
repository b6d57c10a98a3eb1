"""The KD term as a config names it, and the one formula that weighs it against the student's cross-entropy.

``build_kd_loss(kind, temperature, **options)`` binds a divergence of ``KD_LOSSES`` to its temperature and options
and is where they are checked (names and ranges), once, before anything is loaded: the ``kd`` recipe's schema
checks the same ranges at config load, and ``build_kd_loss`` is the public entry for code that builds a loss
without a config (benchmarks, tests). ``blend`` is the training objective ``(1 - kd_ratio) * CE + kd_ratio * KD``;
every path of ``kd_and_ce`` takes its loss (and, where autograd computes it, its gradient) from it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor

from ..errors import RecipeError
from .divergences import KD_LOSSES

__all__ = ["KDLoss", "blend", "build_kd_loss"]

# option -> (lower bound open, upper bound open, hint); every option is a number in the unit interval
_OPTION_RANGES = {
    "ratio": (False, False, ""),
    "beta": (True, True, " (JSD is identically 0 at 0 and 1; use kind=forward_kl for TRL's beta=0, "
                         "kind=reverse_kl for beta=1)"),
    "alpha": (False, True, ""),
}
_NOT_OPTIONS = ("student_logits", "teacher_logits", "labels", "temperature", "ignore_index")


@dataclass(frozen=True)
class KDLoss:
    """A divergence of ``KD_LOSSES`` bound to its temperature and options (build it with ``build_kd_loss``).

    ``loss(student_logits [n, v], teacher_logits [n, v], labels [n])`` is the divergence's sum over valid tokens.
    The loss paths read ``kind`` (forward KL has a closed-form gradient) and ``temperature`` (a top-k cache fixes it).
    """

    kind: str
    temperature: float = 1.0
    options: Mapping[str, float] = field(default_factory=dict)

    def __call__(self, student_logits: Tensor, teacher_logits: Tensor, labels: Tensor) -> Tensor:
        return KD_LOSSES[self.kind](student_logits, teacher_logits, labels, self.temperature, **self.options)


def _options_of(kind: str) -> list[str]:
    """The hyper-parameters divergence ``kind`` takes besides the temperature (e.g. ``["beta"]`` for jsd)."""
    return [p for p in inspect.signature(KD_LOSSES[kind]).parameters if p not in _NOT_OPTIONS]


def build_kd_loss(kind: str, temperature: float = 1.0, **options: float) -> KDLoss:
    """Bind divergence ``kind`` (a config string) to its temperature and options; a RecipeError names a wrong kind,
    an option the kind does not take, or a value out of range (T > 0; ratio in [0, 1], beta in (0, 1), alpha in
    [0, 1))."""
    if kind not in KD_LOSSES:
        raise RecipeError(f"unknown kd loss kind {kind!r}; valid kinds: {', '.join(KD_LOSSES)}")
    allowed = _options_of(kind)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise RecipeError(f"kd loss {kind!r} does not take {', '.join(unknown)}; its options are: {', '.join(allowed)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise RecipeError(f"kd temperature must be a positive number, got {temperature!r}")
    for name, value in options.items():
        lo_open, hi_open, hint = _OPTION_RANGES[name]
        ok = isinstance(value, (int, float)) and (0.0 < value if lo_open else 0.0 <= value)
        if not (ok and (value < 1.0 if hi_open else value <= 1.0)):
            lo, hi = ("(" if lo_open else "["), (")" if hi_open else "]")
            raise RecipeError(f"kd {kind} {name} must be in {lo}0, 1{hi}, got {value!r}{hint}")
    return KDLoss(kind, float(temperature), {name: float(value) for name, value in options.items()})


def blend(ce: Tensor, kd: Tensor, kd_ratio: float) -> Tensor:
    """The training objective ``(1 - kd_ratio) * ce + kd_ratio * kd`` (sums over valid tokens: divide by a count)."""
    return (1.0 - kd_ratio) * ce + kd_ratio * kd
