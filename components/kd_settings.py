"""kd's `kd:` section: the divergence, its options and the CE/KD blend, and on-policy distillation (`kd.on_policy`).

The loss of a micro-batch is `(1 - kd_ratio) * CE + kd_ratio * KD(teacher || student)` (components/losses: `kd_and_ce`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from .errors import RecipeError
from .losses import KD_LOSSES, KDLoss, build_kd_loss
from .on_policy import KD_OPTIONS, OnPolicySettings
from .schema import Choice, Range
from .settings import section, setting


@dataclass(frozen=True, kw_only=True)
class KDSettings:
    """The `kd:` section of recipes/kd.py."""

    loss: str = setting("forward_kl", Choice(*KD_LOSSES), "the divergence: forward_kl | reverse_kl | symmetric_kl | "
                        "jsd | skew_kl | skew_reverse_kl")
    kd_ratio: float = setting(0.5, Range(float, ge=0, le=1), "loss = (1 - kd_ratio) * CE + kd_ratio * KD")
    temperature: float = setting(1.0, Range(float, gt=0), "softens both distributions; the KD term is scaled by T^2")
    beta: float | None = setting(None, Range(float, gt=0, lt=1, optional=True), "jsd only: mixture weight of the "
                                 "teacher (null: 0.5)")
    alpha: float | None = setting(None, Range(float, ge=0, lt=1, optional=True), "skew_kl: the teacher's share of "
                                  "the mixture; skew_reverse_kl: the student's (null: 0.1)")
    ratio: float | None = setting(None, Range(float, ge=0, le=1, optional=True), "symmetric_kl only: weight of "
                                  "forward vs reverse KL (null: 0.5)")
    on_policy: OnPolicySettings | None = section(OnPolicySettings, "on-policy KD: a fraction of the micro-batches "
                                                 "are the student's own samples scored by the teacher (null: off)",
                                                 optional=True)

    def loss_fn(self) -> KDLoss:
        """The divergence bound to its temperature and the options set; a RecipeError names an option the kind
        does not take, its value and the kinds that take it (a check across keys: run at load by the recipe's
        `check()`)."""
        options = {o: getattr(self, o) for o in KD_OPTIONS if getattr(self, o) is not None}
        for option, value in options.items():
            if option not in inspect.signature(KD_LOSSES[self.loss]).parameters:
                kinds = [k for k in KD_LOSSES if option in inspect.signature(KD_LOSSES[k]).parameters]
                raise RecipeError(f"kd.{option}={value}: kd.loss={self.loss} does not read it ({option} is an "
                                  f"option of {' and '.join(kinds)}); set kd.{option}: null, or a kd.loss that takes it")
        return build_kd_loss(self.loss, self.temperature, **options)
