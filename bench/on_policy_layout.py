"""`python -m llm_recipe.cli.main ARGS` with on-policy KD's training micro-batches changed, for diagnosis rows of
bench/on_policy_speed.py. Why: on one H200 (session 56) an on-policy micro-batch of the shipped text row (~15
samples of 160 tokens, one per row: ~2,400 tokens) trained in about the time of a 4,096-token data micro-batch.
Every mode counts each micro-batch the loader dealt a step as a data one (the loader's rows x max_seq_len; on-policy
ones joined into one pass count as those they hold), so tokens/s compares step times across layouts:

- `steptime`: nothing else (the shipped layout: one sample per row, padded, or packed where that holds fewer tokens;
  consecutive ones of one sample per row joined while they fit a data micro-batch's positions);
- `packed`: every on-policy micro-batch packed back into its training rows (the loader's shape, whose compiled
  graphs the data micro-batches already use), however many tokens that holds;
- `padded`: every on-policy micro-batch one sample per row, padded to the longest, each its own pass, as before
  session 52 (chat prompts: `onpolicy_compiled_chat_padded`);
- `apart`: the shipped layout without joining (each on-policy micro-batch its own pass, as before session 59);
- `static`: the shipped layout, with Dynamo's automatic dynamic shapes off (and room for more recompiles): each
  on-policy shape gets a static graph, as the loader's shape has, instead of one graph with dynamic sizes;
- `microbatch`: the shipped layout, and a line per step with each micro-batch's time between CUDA events recorded
  as the loop moves it to the device (`microbatch_ms: [[on_policy, shape, ms], ...]`; the last one's time runs to
  the optimizer step, so it holds the gradient clipping and the step's reductions too).

    python bench/on_policy_layout.py steptime|packed|padded|apart|static|microbatch run kd --config ...
"""

from __future__ import annotations

import json
import sys

MODES = ("steptime", "packed", "padded", "apart", "static", "microbatch")


def main() -> int:
    import torch._dynamo

    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy, on_policy_sampling
    from llm_recipe.components.training import Throughput

    how, args = sys.argv[1], sys.argv[2:]
    if how not in MODES:
        raise SystemExit(f"on_policy_layout.py: one of {', '.join(MODES)}, not {how!r}")
    sample_window, rate, dealt = on_policy.OnPolicy.sample_window, Throughput.rate, []

    def remembered(self, model, window, step):  # the loader's window, before its on-policy micro-batches change
        dealt[:] = window
        return sample_window(self, model, window, step)

    on_policy.OnPolicy.sample_window = remembered
    Throughput.rate = lambda self, window, rt: rate(self, [dealt[0] if dealt else window[0]] * len(dealt or window), rt)
    if how == "packed":  # the padded layout's comparison loses: its `tokens` count as more than any packed batch
        padded = on_policy_sampling.completion_batch

        class _More:
            def numel(self) -> int:
                return 1 << 62

        on_policy_sampling.completion_batch = lambda *a, **k: {**padded(*a, **k), "tokens": _More()}
    if how == "padded":
        on_policy_sampling.packed_completion_batch = (
            lambda prompts, completions, pad_id, *_: on_policy_sampling.completion_batch(prompts, completions, pad_id))
    if how in ("apart", "padded"):
        on_policy_sampling.joined_runs = lambda sizes, capacity: [[i] for i in range(len(sizes))]
    if how == "static":
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
    if how == "microbatch":
        _time_microbatches()
    return recipe(args)


def _time_microbatches() -> None:
    """Record a CUDA event as each micro-batch moves to the device and one before each optimizer step; print each
    step's micro-batch times."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from llm_recipe.recipes import kd

    marks: list[tuple[bool, list[int], torch.cuda.Event]] = []
    to_device = kd.to_device

    def timed(batch, device):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(("prompt_lens" in batch, list(batch["tokens"].shape), event))
        return to_device(batch, device)

    def step_end(*_):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        ends = [e for *_, e in marks[1:]] + [end]
        print("microbatch_ms: " + json.dumps([[on, shape, round(e0.elapsed_time(e1), 2)]
                                               for (on, shape, e0), e1 in zip(marks, ends)]), flush=True)
        marks.clear()

    kd.to_device = timed
    register_optimizer_step_pre_hook(step_end)


if __name__ == "__main__":
    sys.exit(main())
