"""llm_recipe.components.eval.stats: the standard errors the demo and the KD study print, from lm-eval's per-item samples."""

import math
import random

import pytest

from llm_recipe.components.eval.stats import loglikelihood_task_stats, paired_difference, per_item


def _samples(accs, lls):
    return [{"doc_id": i, "acc": a, "perplexity": ll} for i, (a, ll) in enumerate(zip(accs, lls))]


def test_accuracy_and_perplexity_standard_errors():
    from lm_eval.api.metrics import mean_stderr

    rng = random.Random(0)
    accs = [float(rng.random() < 0.3) for _ in range(400)]
    lls = [-rng.expovariate(0.5) for _ in range(400)]  # lm-eval logs each target's log-likelihood
    s = loglikelihood_task_stats(_samples(accs, lls))
    assert s["items"] == 400
    assert s["acc"] == pytest.approx(sum(accs) / 400)
    assert s["acc_se"] == pytest.approx(mean_stderr(accs))  # lm-eval's own accuracy SE
    nll = [-x for x in lls]
    assert s["ppl"] == pytest.approx(math.exp(sum(nll) / 400))  # lm-eval's perplexity aggregation
    assert s["nll_se"] == pytest.approx(mean_stderr(nll))
    assert s["ppl_se"] == pytest.approx(s["ppl"] * s["nll_se"])  # delta method
    # The delta-method SE agrees with a bootstrap of exp(mean NLL) (what lm-eval would compute, slowly).
    boot = []
    for _ in range(2000):
        draw = [nll[rng.randrange(400)] for _ in range(400)]
        boot.append(math.exp(sum(draw) / 400))
    m = sum(boot) / len(boot)
    sd = math.sqrt(sum((b - m) ** 2 for b in boot) / (len(boot) - 1))
    assert s["ppl_se"] == pytest.approx(sd, rel=0.15)


def test_paired_difference_uses_the_common_items_and_their_correlation():
    a = {0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0, 4: 0.0}
    b = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0, 9: 1.0}  # item 9 only in b: ignored
    d = paired_difference(a, b)
    assert d["items"] == 5 and d["diff"] == pytest.approx(0.4)
    diffs = [1, 0, 1, 0, 0]
    sd = math.sqrt(sum((x - 0.4) ** 2 for x in diffs) / 4)
    assert d["se"] == pytest.approx(sd / math.sqrt(5)) and d["z"] == pytest.approx(0.4 / d["se"])
    assert per_item(_samples([1.0, 0.0], [-1.0, -2.0]), "acc") == {0: 1.0, 1: 0.0}


def test_results_left_without_standard_errors_get_the_closed_forms():
    """`recipe demo` evaluates with bootstrap_iters=0: lm-eval's table said Stderr N/A beside a summary with SEs;
    now lm-eval's results (its table, results.json) carry the same SEs the summary prints."""
    from llm_recipe.components.eval.stats import fill_closed_form_stderrs

    samples = _samples([1.0, 0.0, 1.0, 1.0], [-1.0, -2.5, -0.5, -1.5])
    results = {"results": {"t": {"acc,none": 0.75, "acc_stderr,none": "N/A", "perplexity,none": 4.48,
                                 "perplexity_stderr,none": "N/A", "alias": "t"}},
               "versions": {"t": 1.0}, "n-shot": {"t": 0}, "higher_is_better": {"t": {"acc": True, "perplexity": False}},
               "samples": {"t": samples}}
    fill_closed_form_stderrs(results)
    s = loglikelihood_task_stats(samples)
    assert results["results"]["t"]["acc_stderr,none"] == pytest.approx(s["acc_se"])
    assert results["results"]["t"]["perplexity_stderr,none"] == pytest.approx(s["ppl_se"])
    from lm_eval.utils import make_table

    assert "N/A" not in make_table(results)
