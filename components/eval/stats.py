"""Standard errors from lm-eval's per-item samples: accuracy and perplexity of one model, and the paired
difference of two models scored on the same items.

Closed forms instead of lm-eval's bootstrap: its perplexity standard error resamples 100000 times in a process
pool (seconds to minutes of CPU per evaluation); the delta method gives the same quantity at once.
- accuracy: mean of 0/1 per item, SE = sample sd / sqrt(n) (as lm-eval's `mean_stderr`);
- perplexity: exp(mean NLL), SE = ppl * sd(NLL) / sqrt(n) (first-order delta method);
- paired difference (same items): SE = sd(per-item difference) / sqrt(n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample sd / sqrt(n)); for 0/1 accuracies this is lm-eval's `mean_stderr`."""
    n = len(xs)
    if n == 0:
        raise ValueError("no items")
    mean = sum(xs) / n
    if n < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def per_item(samples: Sequence[dict], metric: str) -> dict[int, float]:
    """`{doc_id: value}` of one metric from lm-eval's logged samples (`results["samples"][task]`)."""
    return {int(s["doc_id"]): float(s[metric]) for s in samples}


def loglikelihood_task_stats(samples: Sequence[dict]) -> dict:
    """Items, accuracy +- SE and perplexity +- SE of a loglikelihood task with `acc` and `perplexity` metrics
    (LAMBADA): lm-eval logs each item's target log-likelihood under `perplexity`."""
    acc, acc_se = mean_se(list(per_item(samples, "acc").values()))
    ppl, ppl_se, nll, nll_se = _perplexity(samples)
    return {"items": len(samples), "acc": acc, "acc_se": acc_se, "ppl": ppl, "ppl_se": ppl_se,
            "nll": nll, "nll_se": nll_se}


def _perplexity(samples: Sequence[dict]) -> tuple[float, float, float, float]:
    """exp(mean NLL) and its delta-method SE, the mean NLL and its SE, from the per-item `perplexity` samples
    (lm-eval logs each target's log-likelihood there)."""
    nll, nll_se = mean_se([-v for v in per_item(samples, "perplexity").values()])
    ppl = math.exp(nll)
    return ppl, ppl * nll_se, nll, nll_se


def fill_closed_form_stderrs(results: dict) -> None:
    """Put the closed-form SEs of `acc`, `acc_norm` and `perplexity` into lm-eval's results where it left "N/A"
    (an evaluation with bootstrap_iters=0 and logged samples, as `recipe demo`'s), so its table and results.json
    show the SEs the summary uses."""
    for task, samples in (results.get("samples") or {}).items():
        row = results.get("results", {}).get(task, {})
        for key, value in list(row.items()):
            metric = key.partition(",")[0]
            if value != "N/A" or not metric.endswith("_stderr"):
                continue
            name = metric.removesuffix("_stderr")
            if not samples or any(name not in s for s in samples):
                continue
            if name in ("acc", "acc_norm"):
                row[key] = mean_se(list(per_item(samples, name).values()))[1]
            elif name == "perplexity":
                row[key] = _perplexity(samples)[1]


def z_score(diff: float, se: float) -> float:
    """diff / se; with no spread (se 0) +-inf for a real difference and 0 for none (0 / 0 is no evidence)."""
    return diff / se if se > 0 else (math.copysign(math.inf, diff) if diff else 0.0)


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    """Mean of `b - a` over the items both have, its SE and z = mean / SE."""
    common = sorted(set(a) & set(b))
    diff, se = mean_se([b[i] - a[i] for i in common])
    return {"items": len(common), "diff": diff, "se": se, "z": z_score(diff, se)}
