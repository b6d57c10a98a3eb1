"""bench/multi_gpu.py's step times for on-policy rows: the mean over the timed steps, and the same without the run's
first on-policy step, which compiles the decode step when a small share puts it after the warm-up (session 65)."""

from __future__ import annotations


def test_the_steady_step_time_leaves_out_the_first_sampling_step_only():
    from bench.multi_gpu import steady_step_seconds

    # 10 steps of 1.0 s; step 4 samples first (+25 s of compile), step 8 samples again (+0.2 s)
    seconds = {k: 1.0 + (25.0 if k == 4 else 0.2 if k == 8 else 0.0) for k in range(1, 11)}
    at = {k: sum(seconds[j] for j in range(1, k + 1)) for k in range(1, 11)}
    steps = [{"step": k, "on_policy_batches": int(k in (4, 8))} for k in range(1, 11)]
    mean = (at[10] - at[3]) / 7  # step_s_mean with warm-up 3
    assert abs(mean - (7 + 25.2) / 7) < 1e-9
    assert abs(steady_step_seconds(at, steps, 3) - 6.2 / 6) < 1e-9  # step 8's sampling stays in
    # the first sampling step inside the warm-up (a share of 0.1: step 1): nothing left out
    steps = [{"step": k, "on_policy_batches": int(k in (1, 4, 8))} for k in range(1, 11)]
    assert abs(steady_step_seconds(at, steps, 3) - mean) < 1e-9
    # an off-policy row: no sampling step
    assert abs(steady_step_seconds(at, [{"step": k} for k in range(1, 11)], 3) - mean) < 1e-9
    assert steady_step_seconds({}, [], 3) is None
