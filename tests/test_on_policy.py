"""On-policy KD's parts (kd.on_policy, components/on_policy.py): which micro-batches go on-policy, the prompts of
training rows, the sampling (KV cache, seeded, laid out by global row; the compiled and CUDA-graph decode steps),
the completion-only labels, and the loss against the reference divergences (values and gradients; nothing on
prompt positions) and the held-out score. The prompt set and the config checks: test_on_policy_settings.py; the
kd recipe with it: test_on_policy_recipe.py."""

from __future__ import annotations

import math

import kd_reference as ref
import pytest
import torch
from omegaconf import OmegaConf

from llm_recipe.components.losses import KD_LOSSES, LiveTeacher, build_kd_loss, kd_and_ce
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.on_policy import (
    OnPolicySettings,
    is_on_policy,
    on_policy_kd_loss,
    per_prompt_summary,
    prompts_of,
    row_prompts,
    score_samples,
)
from llm_recipe.components.on_policy_sampling import (
    completion_batch,
    packed_completion_batch,
    sample_completions,
    sample_with_uniforms,
)

IGNORE = -100
ARGS = ModelArgs(family="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                 tie_word_embeddings=False, qkv_bias=False, o_bias=False)
PROMPTS = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 2, 6]]
COMPLETIONS = [[11, 12, 13], [20, 21, 22, 23, 24], [30]]


def _model(seed: int, lora: LoRASettings | None = None, scale: float = 4.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(ARGS, lora=lora).double()
    with torch.no_grad():  # peaked, model-specific next-token distributions (random init is near uniform)
        model.output.weight.mul_(scale)
    return model


def _hidden(model, tokens):
    model.skip_output = True
    try:
        return model(tokens)
    finally:
        model.skip_output = False


# ---------------------------------------------------------------------------------------- choosing, prompts


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.3, 0.5, 1.0])
def test_fraction_is_spread_evenly_and_fixed_by_seed_step_micro(fraction):
    accum = 3
    picks = [is_on_policy(0, step, micro, accum, fraction) for step in range(200) for micro in range(accum)]
    for start, length in ((0, 600), (17, 40), (101, 7)):  # any run of k micro-batches holds ~k * fraction
        assert abs(sum(picks[start:start + length]) - length * fraction) < 1
    assert picks == [is_on_policy(0, s, m, accum, fraction) for s in range(200) for m in range(accum)]
    if 0 < fraction < 1:
        by_seed = {tuple(is_on_policy(seed, s, 0, 1, fraction) for s in range(8)) for seed in range(6)}
        assert len(by_seed) > 1  # the seed moves the phase


def test_prompts_of_text_rows_packed_and_not():
    from llm_recipe.components.data.collate import collate

    doc1, doc2 = list(range(100, 110)), list(range(200, 205))
    packed = collate([{"tokens": doc1 + doc2 + [0], "labels": doc1 + doc2 + [IGNORE], "seq_lens": [10, 5, 1]},
                      {"tokens": doc2 + doc1 + [0], "labels": doc2 + doc1 + [IGNORE], "seq_lens": [5, 10, 1]}], 0)
    assert prompts_of(packed, 4, budget=40) == [doc1[:4], doc2[:4]]
    # never past the first document's second-to-last token (its last is the end-of-text), never over budget
    assert prompts_of(packed, 30, budget=40) == [doc1[:9], doc2[:4]]
    assert prompts_of(packed, 30, budget=3) == [doc1[:3], doc2[:3]]
    plain = collate([{"tokens": doc1, "labels": doc1}, {"tokens": doc2, "labels": doc2}], pad_id=0)
    assert prompts_of(plain, 30, budget=40) == [doc1[:9], doc2[:4]]


def test_row_prompts_takes_one_prompt_per_document_while_they_fit():
    """A packed row's documents each give a prompt, in order, up to `per_row`, skipping its padding and any
    document without targets, and only while prompts + max_new_tokens completions fit in the row's length."""
    from llm_recipe.components.data.collate import collate

    docs = [list(range(100 * k, 100 * k + n)) for k, n in ((1, 10), (2, 5), (3, 1), (4, 7))]
    no_targets = [9] * 4  # e.g. a chat document whose response was cut off: no label
    row = lambda ds, labels, pad: {"tokens": sum(ds, []) + [0] * pad, "labels": sum(labels, []) + [IGNORE] * pad,  # noqa: E731
                                   "seq_lens": [len(d) for d in ds] + ([pad] if pad else [])}
    packed = collate([row(docs, docs, 3), row([docs[1], no_targets, docs[3]], [docs[1], [IGNORE] * 4, docs[3]], 10)], 0)
    # the 1-token document's shifted labels are all IGNORE: no target, no prompt; neither from the padding
    assert row_prompts(packed, 4, budget=40, per_row=8) == [[docs[0][:4], docs[1][:4], docs[3][:4]],
                                                          [docs[1][:4], docs[3][:4]]]
    assert row_prompts(packed, 4, budget=40, per_row=2) == [[docs[0][:4], docs[1][:4]], [docs[1][:4], docs[3][:4]]]
    assert prompts_of(packed, 4, budget=40, per_row=2) == [docs[0][:4], docs[1][:4], docs[1][:4], docs[3][:4]]
    # room: each prompt (4 tokens) and its completion (10) take 14 of budget + max_new_tokens = 30 tokens
    assert row_prompts(packed, 4, budget=20, per_row=8, max_new_tokens=10) == [[docs[0][:4], docs[1][:4]],
                                                                             [docs[1][:4], docs[3][:4]]]
    # the first document always gives one (a prompt is never over budget, so it always fits)
    assert row_prompts(packed, 30, budget=3, per_row=8, max_new_tokens=60) == [[docs[0][:3]], [docs[1][:3]]]


def test_prompts_of_chat_rows_are_the_tokens_before_the_response(embedded_model_dir):
    from llm_recipe.components.data.collate import collate
    from llm_recipe.components.data.formats import make_format
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_dir)
    chat = make_format("chat", tok)
    rows = [chat({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            for q, a in (("What is 2+2?", "4."), ("Name a colour.", "Blue, like the sea."))]
    batch = collate(rows, tok.pad_id)
    prompts = prompts_of(batch, None, budget=500)
    for row, prompt in zip(rows, prompts, strict=True):
        first = next(i for i, lab in enumerate(row["labels"]) if lab != IGNORE)
        assert prompt == row["tokens"][:first] and len(prompt) > 5
        assert tok.decode(prompt).rstrip().endswith("assistant")  # the generation prompt ends it
    assert prompts_of(batch, None, budget=4) == [p[-4:] for p in prompts]  # too long: its end is kept
    packed = collate([{"tokens": rows[0]["tokens"] + rows[1]["tokens"], "labels": rows[0]["labels"] + rows[1]["labels"],
                       "seq_lens": [len(rows[0]["tokens"]), len(rows[1]["tokens"])]}], tok.pad_id)
    assert prompts_of(packed, None, budget=500, per_row=4) == prompts  # each packed chat document's own prompt


def test_completion_batch_labels_only_the_sampled_tokens():
    b = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    assert b["tokens"].shape == (3, 7) and b["prompt_lens"].tolist() == [4, 2, 6]
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        assert b["tokens"][i, : len(p) + len(c)].tolist() == p + c
        targets = [(t, int(y)) for t, y in enumerate(b["labels"][i]) if y != IGNORE]
        assert targets == [(len(p) - 1 + j, tok) for j, tok in enumerate(c)]  # labels[t] = tokens[t + 1]
    assert int((b["labels"] != IGNORE).sum()) == sum(map(len, COMPLETIONS))



def test_packed_completion_batch_trains_what_one_prompt_per_row_trains():
    """A training row's samples packed back into that row (the loader's shape: 2 rows of max_seq_len, not 3 rows
    padded to the longest) carry the same targets, and the on-policy loss and the student's weight gradients on
    them equal those of one prompt per row: each sequence attends only to itself (input_pos restarts)."""
    from llm_recipe.components.training import hidden_states, to_device

    packed = packed_completion_batch(PROMPTS, COMPLETIONS, pad_id=0, max_seq_len=16, per_row=[2, 1])
    padded = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    assert packed["tokens"].shape == (2, 16) and packed["prompt_lens"].tolist() == [4, 2, 6]
    assert packed["tokens"][0, :14].tolist() == [*PROMPTS[0], *COMPLETIONS[0], *PROMPTS[1], *COMPLETIONS[1]]
    assert packed["input_pos"][0, :14].tolist() == [*range(7), *range(7)]
    targets = [int(y) for y in packed["labels"].flatten() if y != IGNORE]
    assert targets == [int(y) for y in padded["labels"].flatten() if y != IGNORE]  # the same tokens, in order
    with pytest.raises(ValueError, match=r"rows of \[2, 2\] prompts for 3 prompts"):
        packed_completion_batch(PROMPTS, COMPLETIONS, pad_id=0, max_seq_len=16, per_row=[2, 2])
    first_fit = packed_completion_batch(PROMPTS, COMPLETIONS, pad_id=0, max_seq_len=14)  # a prompt set's: 7 + 7, 7
    assert first_fit["tokens"].shape == (2, 14) and first_fit["tokens"][0].tolist() == packed["tokens"][0, :14].tolist()
    assert [int(y) for y in first_fit["labels"].flatten() if y != IGNORE] == targets

    student, teacher = _model(1), _model(0)
    loss_fn = on_policy_kd_loss(OnPolicySettings(loss="reverse_kl"), OmegaConf.create({"temperature": 1.0}))
    losses, grads = [], []
    for b in (padded, packed):
        b = to_device(b, torch.device("cpu"))  # packed rows get their attention mask from input_pos here
        student.zero_grad()
        with torch.no_grad():
            target = LiveTeacher(hidden_states(teacher, b), teacher.output)
        parts = kd_and_ce(hidden_states(student, b), student.output, b["labels"], target, loss_fn, 1.0, num_chunks=2)
        parts["loss"].backward()
        losses.append(parts["loss"].detach())
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-9, atol=1e-12)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-7, atol=1e-10, msg=n)


def _trained(batches: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed on-policy loss (reverse KL) of `batches` and the student's weight gradients, one pass per batch
    (packed rows get their attention mask from input_pos in to_device); the same two models every call."""
    from llm_recipe.components.training import hidden_states, to_device

    student, teacher = _model(1), _model(0)
    loss_fn = on_policy_kd_loss(OnPolicySettings(loss="reverse_kl"), OmegaConf.create({"temperature": 1.0}))
    total = 0.0
    for b in batches:
        b = to_device(b, torch.device("cpu"))
        with torch.no_grad():
            target = LiveTeacher(hidden_states(teacher, b), teacher.output)
        parts = kd_and_ce(hidden_states(student, b), student.output, b["labels"], target, loss_fn, 1.0, num_chunks=2)
        parts["loss"].backward()
        total = total + parts["loss"].detach()
    return total, {n: p.grad.clone() for n, p in student.named_parameters()}


def test_consecutive_short_on_policy_micro_batches_train_as_one_pass_with_the_same_gradient():
    """A step's on-policy micro-batches of one sample per row join while their rows x widest row fit a data
    micro-batch's positions (capacity): 3 of 3 rows x 7 fit 20 rows x 7 but not 18 x 7 (then 2 + 1), a packed one
    (the loader's shape) never joins; the joined batch trains every micro-batch's targets with the summed loss and
    the same weight gradients as the micro-batches one by one. With `agree` (several ranks), the reduced sizes
    decide: a wider micro-batch on another rank keeps them apart."""
    from llm_recipe.components.on_policy_sampling import joined_runs, training_batches

    assert joined_runs([[3, 7, 0], [3, 7, 0], [3, 7, 0]], 63) == [[0, 1, 2]]
    assert joined_runs([[3, 7, 0], [3, 7, 0], [3, 7, 0]], 42) == [[0, 1], [2]]
    assert joined_runs([[3, 7, 0], [2, 16, 1], [3, 7, 0], [3, 7, 0]], 64) == [[0], [1], [2, 3]]
    assert joined_runs([[2, 16, 1], [1, 4, 0]], 64) == [[0], [1]]  # a packed run takes no more, however small
    samples = [(PROMPTS, COMPLETIONS, [2, 1]), ([[1, 4], [1, 9, 9]], [[5, 6], [7]], [2]), (PROMPTS[:1], [[2]], [1])]
    joined = training_batches(samples, pad_id=0, max_seq_len=16, capacity=8 * 7)
    assert [run for run, _ in joined] == [[0, 1, 2]]
    (_, batch), alone = joined[0], training_batches(samples, pad_id=0, max_seq_len=16, capacity=0)
    assert [run for run, _ in alone] == [[0], [1], [2]] and batch["tokens"].shape == (6, 7)
    assert batch["prompt_lens"].tolist() == [4, 2, 6, 2, 3, 4]
    wider = training_batches(samples, 0, 16, 8 * 7, agree=lambda s: s.maximum(torch.tensor([[0, 0, 0], [0, 12, 0],
                                                                                           [0, 0, 0]])))
    assert [run for run, _ in wider] == [[0], [1, 2]]  # (3 + 2) x 12 > 56; (2 + 1) x 12 fits

    (loss_joined, grads_joined), (loss_alone, grads_alone) = _trained([batch]), _trained([b for _, b in alone])
    torch.testing.assert_close(loss_joined, loss_alone, rtol=1e-9, atol=1e-12)
    for n, g in grads_alone.items():
        torch.testing.assert_close(grads_joined[n], g, rtol=1e-7, atol=1e-10, msg=n)


def test_loader_shaped_batches_train_every_sample_in_the_loaders_shape_with_the_same_gradient():
    """Where every data micro-batch is batch_size x max_seq_len (4 x 16 here), a step's samples (3 micro-batches,
    6 sequences of 7, 7, 7, 4, 4 and 5 tokens) train first fit in rows of max_seq_len (7 + 7, 7 + 4 + 4 and 5
    tokens), in passes of batch_size rows or half of them, each sequence attending only to itself; the summed
    loss and the weight gradients equal those of each micro-batch one sample per row. With `agree` asking for more
    passes (another rank's), rows of several sequences split so that every pass holds samples; beyond that a pass
    holds only empty rows."""
    from llm_recipe.components.on_policy_sampling import in_window, loader_shaped_batches

    samples = [(PROMPTS, COMPLETIONS, [2, 1]), ([[1, 4], [1, 9, 9]], [[5, 6], [7]], [2]), (PROMPTS[:1], [[2]], [1])]
    passes = loader_shaped_batches(samples, pad_id=0, max_seq_len=16, batch_size=4)
    assert [tuple(b["tokens"].shape) for b in passes] == [(4, 16)]  # 3 rows: more than half
    assert all(set(b) == {"tokens", "labels", "input_pos", "prompt_lens"} for b in passes)
    assert passes[0]["prompt_lens"].tolist() == [4, 2, 6, 2, 3, 4]
    assert passes[0]["tokens"][0, :14].tolist() == [*PROMPTS[0], *COMPLETIONS[0], *PROMPTS[1], *COMPLETIONS[1]]
    assert passes[0]["tokens"][3].tolist() == [0] * 16  # an empty row
    alone = [completion_batch(p, c, pad_id=0) for p, c, _ in samples]
    targets = lambda bs: [int(y) for b in bs for y in b["labels"].flatten() if y != IGNORE]  # noqa: E731
    assert targets(passes) == targets(alone)
    two = loader_shaped_batches(samples, 0, 16, 4, agree=lambda n: n.maximum(torch.tensor([[2]])))
    assert [tuple(b["tokens"].shape) for b in two] == [(2, 16), (2, 16)] and targets(two) == targets(alone)
    more = loader_shaped_batches(samples, 0, 16, 4, agree=lambda n: n.maximum(torch.tensor([[5]])))
    assert len(more) == 5 and all(b["tokens"].shape == (2, 16) for b in more)
    assert all((b["labels"] != IGNORE).any() for b in more) and targets(more) == targets(alone)
    most = loader_shaped_batches(samples, 0, 16, 4, agree=lambda n: n.maximum(torch.tensor([[7]])))
    assert [int((b["labels"] != IGNORE).sum() > 0) for b in most] == [1] * 6 + [0]  # 6 sequences, 7 passes
    assert targets(most) == targets(alone)
    window = ["d0", "m1", "d2", "m3", "m4"]
    assert in_window(window, [1, 3, 4], ["a", "b"]) == ["d0", "a", "d2", "b"]
    assert in_window(window, [1, 3], ["a", "b", "c"]) == ["d0", "a", "d2", "b", "c", "m4"]

    (loss, grads), (loss_alone, grads_alone) = _trained(most), _trained(alone)
    torch.testing.assert_close(loss, loss_alone, rtol=1e-9, atol=1e-12)
    for n, g in grads_alone.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-7, atol=1e-10, msg=n)


# ---------------------------------------------------------------------------------------- sampling


def test_generate_batch_keeps_the_stop_token_and_takes_pick_and_all_done():
    from llm_recipe.components.models.generation import generate_batch

    model = _model(0).float().eval()
    greedy = generate_batch(model, PROMPTS, 10, pad_id=0)
    stop = greedy[0][3]
    cut = generate_batch(model, PROMPTS, 10, pad_id=0, stop_ids=[stop])
    kept = generate_batch(model, PROMPTS, 10, pad_id=0, stop_ids=[stop], keep_stop=True)
    assert kept[0] == cut[0] + [stop] == greedy[0][: greedy[0].index(stop) + 1]
    assert generate_batch(model, PROMPTS, 5, pad_id=0, pick=lambda logits: torch.full_like(logits[:, 0], 7,
                                                                                            dtype=torch.long)) == [[7] * 5] * 3
    asked = []
    generate_batch(model, PROMPTS, 40, pad_id=0, stop_ids=list(range(61)), all_done=lambda d: asked.append(1) or False)
    assert len(asked) == 2  # every row stopped at once, but the caller said no: asked at steps 16 and 32


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(20000, 5)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    picks = sample_with_uniforms(logits, 1.0, u)
    freq = torch.bincount(picks, minlength=5).double() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.01, rtol=0)
    hot = torch.bincount(sample_with_uniforms(logits, 0.25, u), minlength=5).double() / 20000
    assert hot[0] > 0.95  # a low temperature sharpens it


@pytest.mark.parametrize("vocab", [61, 256, 1000, 49152])
def test_inverse_cdf_in_blocks_picks_what_one_fp64_cdf_picks(vocab):
    """The block sums + one block's CDF pick the token one fp64 CDF over the whole vocabulary picks, for vocabularies
    that fill their last block or not, flat and peaked (a low temperature), uniforms from 0 to nearly 1."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=gen) * 4
    u = torch.cat([torch.tensor([0.0, 1e-9, 1 - 1e-9]), torch.rand(253, generator=gen)])
    for temperature in (1.0, 0.3):
        cdf = torch.softmax(logits / temperature, -1).double().cumsum(-1)
        want = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        assert torch.equal(sample_with_uniforms(logits, temperature, u), want.clamp_max(vocab - 1))


def test_inverse_cdf_in_blocks_never_picks_an_id_of_probability_zero():
    """A uniform at a block's edge, where the block sums and the block's own CDF round apart (0.5 against 0.5 plus
    254 probabilities of 2^-56): the id taken has probability, the block's last such one; one fp64 CDF over the
    vocabulary takes the next block's first."""
    logits = torch.full((1, 512), -math.inf)
    logits[0, 0] = logits[0, 256] = 0.0
    logits[0, 1:255] = math.log(2.0**-55)  # token 255: probability 0
    picked = int(sample_with_uniforms(logits, 1.0, torch.tensor([0.5])))
    assert torch.softmax(logits, -1)[0, picked] > 0 and picked == 254


def test_samples_are_seeded_and_laid_out_by_global_row():
    """Rank k's row r takes global row r * world + k: two ranks with 2 prompts each sample what one process with
    the 4 prompts samples (same seed), whatever their batch neighbours."""
    model = _model(0).float().train()
    prompts = [[1, 5, 9], [1, 7], [1, 3, 3, 8], [1, 2]]
    kw = dict(max_new_tokens=12, temperature=1.0, pad_id=0, stop_ids=[])
    one = sample_completions(model, prompts, seed=5, rows=range(4), width=4, **kw)
    assert model.training and not model.caches_are_enabled()  # back to training, no KV cache left
    assert one == sample_completions(model, prompts, seed=5, rows=range(4), width=4, **kw)
    assert one != sample_completions(model, prompts, seed=6, rows=range(4), width=4, **kw)
    rank0 = sample_completions(model, prompts[0::2], seed=5, rows=[0, 2], width=4, **kw)
    rank1 = sample_completions(model, prompts[1::2], seed=5, rows=[1, 3], width=4, **kw)
    assert [rank0[0], rank1[0], rank0[1], rank1[1]] == one
    assert all(len(c) == 12 and max(c) < 61 for c in one)
    assert max(max(c) for c in sample_completions(model, prompts, seed=5, rows=range(4), width=4, vocab_size=10,
                                                  **kw)) < 10


def test_several_micro_batches_sampled_at_once_draw_what_each_draws_alone():
    """A step's on-policy micro-batches sampled in one batch (one seed each, a prompt's slot offset by its
    micro-batch's index x width) give each prompt the completion it gets when its micro-batch samples alone."""
    model = _model(0).float().train()
    first, second = [[1, 5, 9], [1, 7]], [[1, 3, 3, 8], [1, 2], [1, 4]]
    kw = dict(max_new_tokens=10, temperature=1.0, pad_id=0, stop_ids=[], width=3)
    alone = (sample_completions(model, first, seed=11, rows=[0, 2], **kw)
             + sample_completions(model, second, seed=12, rows=[2, 0, 1], **kw))
    together = sample_completions(model, first + second, seed=[11, 12], rows=[0, 2, 5, 3, 4], **kw)
    assert together == alone
    assert together != sample_completions(model, first + second, seed=[12, 11], rows=[0, 2, 5, 3, 4], **kw)


def test_sampling_groups_join_micro_batches_while_the_decode_batch_stays_in_bounds():
    """Consecutive micro-batches join a group while its prompts stay <= max_rows and prompts x widest row stay
    <= max_tokens; one too large is a group of its own."""
    from llm_recipe.components.on_policy_prompts import sampling_groups

    short = [16, 128]  # 16 prompts, rows of 128 (padded prompt + new tokens)
    assert sampling_groups([short] * 4, max_rows=64, max_tokens=16 * 2048) == [[0, 1, 2, 3]]
    assert sampling_groups([short] * 5, max_rows=64, max_tokens=16 * 2048) == [[0, 1, 2, 3], [4]]
    # rows of 1000 with the first: 32 x 1000 <= 16 x 2048; a third: 48 x 1000 is not
    assert sampling_groups([short, [16, 1000], short], 64, 16 * 2048) == [[0, 1], [2]]
    assert sampling_groups([short, [16, 1088], short], 64, 16 * 2048) == [[0], [1], [2]]  # 32 x 1088 > 16 x 2048
    assert sampling_groups([[16, 4096], short], 64, 16 * 2048) == [[0], [1]]
    assert sampling_groups([], 64, 16 * 2048) == []
    assert sampling_groups([[10, 1100], [10, 1100], [10, 1100]], 64, 16 * 2048) == [[0, 1], [2]]  # 29 rows of 1100


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_sampling_and_compiled_training_layers_never_recompile_each_other(checkpointed):
    """The compiled decode step (StaticDecode) between training steps of layers compiled one by one (as
    rt.prepare_model does, with activation checkpointing or not): once the training shapes are seen, nothing
    recompiles (Dynamo's error_on_recompile): the prompt forward runs eagerly, the decode step inlines the layers
    into its own graph, and the layers' `kv_cache = None` is put back where it was. The step reads the weights the
    optimizer updates in place: its samples are those of an uncompiled twin trained the same way. Dynamo with the
    eager backend (its guards decide recompiles; Inductor's kernels and CUDA graphs need a GPU to check)."""
    import torch._dynamo

    from llm_recipe.components.models.generation import StaticDecode
    from llm_recipe.components.runtime import _checkpoint_forward

    torch._dynamo.reset()
    model, twin = _model(0).float(), _model(0).float()
    for layer in model.layers:
        if checkpointed:
            _checkpoint_forward(layer)
        layer.compile(backend="eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    static = StaticDecode(6, mode="default", backend="eager")
    kw = dict(max_new_tokens=8, temperature=1.0, pad_id=0, stop_ids=[], seed=3, rows=range(3), width=6)

    def train(width: int, seed: int) -> None:
        tokens = torch.randint(1, 61, (2, width), generator=torch.Generator().manual_seed(seed))
        for m, opt in zip((model, twin), opts, strict=True):
            m.train()
            kd_and_ce(_hidden(m, tokens), m.output, tokens.roll(-1, 1), num_chunks=2)["loss"].backward()
            opt.step()
            opt.zero_grad()

    def sample(n: int) -> list[list[int]]:
        got = sample_completions(model, PROMPTS[:n], **{**kw, "rows": range(n)}, static=static)
        assert got == sample_completions(twin, PROMPTS[:n], **{**kw, "rows": range(n)})
        assert model.training and all(layer.attn.kv_cache is None for layer in model.layers)
        return got

    train(12, 0)
    train(7, 1)  # a second width: the layers' graph goes dynamic (what Dynamo does for any training run)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the decode step's first compile is no recompile
        first = sample(3)
        for step in range(2, 6):
            train(12, step)
            train(5 + step, 10 + step)
            sample(1 + step % 3)
    assert sample(3) != first  # the weights moved and the compiled step saw it
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs and Inductor's GPU kernels")
def test_cuda_graph_sampling_is_recorded_once_and_reads_the_trained_weights(monkeypatch):
    """On a GPU: the on-policy sampler's decode step (StaticDecode, mode reduce-overhead) between training steps of
    layers compiled with Inductor: sampling never recompiles, no CUDA-graph skip, one recording for all samplings (a
    re-record per micro-batch would show here), and the samples of an uncompiled twin trained the same way."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from llm_recipe.components.models.generation import StaticDecode

    recorded = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function",
                        lambda self, *a, **k: recorded.append(1) or record(self, *a, **k))
    torch._dynamo.reset()
    counters.clear()
    model, twin = _model(0).float().cuda(), _model(0).float().cuda()
    for layer in model.layers:
        layer.compile()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    static = StaticDecode(6, mode="reduce-overhead")
    kw = dict(max_new_tokens=24, temperature=1.0, pad_id=0, stop_ids=[], seed=3, width=6)

    def train(width: int, seed: int) -> None:
        tokens = torch.randint(1, 61, (2, width), generator=torch.Generator().manual_seed(seed)).cuda()
        for m, opt in zip((model, twin), opts, strict=True):
            m.train()
            kd_and_ce(_hidden(m, tokens), m.output, tokens.roll(-1, 1), num_chunks=2)["loss"].backward()
            opt.step()
            opt.zero_grad()

    train(12, 0)
    train(7, 1)
    samples = []
    for step in range(2, 7):
        n = 1 + step % 3
        with torch._dynamo.config.patch(error_on_recompile=True):  # sampling never recompiles
            got = sample_completions(model, PROMPTS[:n], rows=range(n), static=static, **kw)
            assert got == sample_completions(twin, PROMPTS[:n], rows=range(n), **kw)
        samples.append(got)
        train(12, step)  # training between samplings, at a width it has not seen: the fused loss compiles one
        train(5 + step, 10 + step)  # graph per chunk shape (losses/fused.py), which must not disturb the decode graph
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(recorded) == 1, f"{len(recorded)} CUDA graph recordings"
    assert samples[0] != samples[3]  # same prompts and seed: the weights moved and the graph read them
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("kind", ref.KINDS)
@pytest.mark.parametrize("head", ["plain", "lora"])
def test_on_policy_loss_is_the_divergence_on_completion_tokens(kind, head):
    """On fixed samples, the recipe's on-policy loss (kd_and_ce at kd_ratio 1 over completion_batch's labels) is the
    reference divergence summed over completion tokens, with the same gradients; the fused driver (plain head)
    and the checkpointed one (LoRA head) alike."""
    lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "lm_head")) if head == "lora" else None
    student, teacher = _model(1, lora), _model(0)
    if lora is not None:
        with torch.no_grad():  # LoRA B starts at 0: make the adapters count
            for n, p in student.named_parameters():
                if "lora_b" in n:
                    p.normal_(0, 0.3)
    kd_cfg = OmegaConf.create({"temperature": 1.5, **ref.OPTIONS.get(kind, {})})
    loss_fn = on_policy_kd_loss(OnPolicySettings(loss=kind), kd_cfg)
    b = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        t_hidden = _hidden(teacher, b["tokens"])
    hidden = _hidden(student, b["tokens"]).detach().requires_grad_(True)
    parts = kd_and_ce(hidden, student.output, b["labels"], LiveTeacher(t_hidden, teacher.output), loss_fn, 1.0,
                      num_chunks=3)
    parts["loss"].backward()

    h_ref = hidden.detach().clone().requires_grad_(True)
    s_logits, t_logits = student.output(h_ref).flatten(0, 1), teacher.output(t_hidden).flatten(0, 1)
    expected = ref.divergence(kind, s_logits, t_logits, b["labels"].flatten(), 1.5, **ref.OPTIONS.get(kind, {}))
    expected.backward()
    assert int(parts["n"]) == sum(map(len, COMPLETIONS))
    torch.testing.assert_close(parts["loss"].detach(), expected.detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=1e-7, atol=1e-10)
    assert parts["loss"] > 0


def test_score_samples_per_prompt_reverse_kl_and_teacher_nll_whatever_the_batch():
    """The held-out metric per prompt: the student's sample of prompt i depends on (seed, i) alone (so every
    student evaluated with one seed sees the same noise, whatever the batch), its reverse KL and teacher NLL sums
    are the reference ones on that row, and the summary holds per-prompt means, their mean and the count. Split
    over ranks, each scores its share with as many samplings as the others, and the gathered result is one
    process's."""
    student, teacher = _model(1).float(), _model(0).float()
    prompts = [*PROMPTS, [1, 2]]
    kw = dict(max_new_tokens=6, temperature=1.0, pad_id=0, stop_ids=[], seed=3, width=len(prompts))

    def sample(chunk, rows):
        return sample_completions(student, chunk, rows=rows, **kw)

    one = score_samples(student, teacher, prompts, sample, batch=4, pad_id=0, num_chunks=2)
    alone = score_samples(student, teacher, prompts, sample, batch=1, pad_id=0, num_chunks=3)
    assert alone["tokens"] == one["tokens"]  # the same samples (a different batch only rounds differently)
    for k in ("reverse_kl_sum", "teacher_nll_sum"):
        assert alone[k] == pytest.approx(one[k], rel=1e-5)
    b = completion_batch(prompts, sample_completions(student, prompts, rows=range(4), **kw), pad_id=0)
    with torch.no_grad():
        s_logits = student.output(_hidden(student, b["tokens"]))
        t_logits = teacher.output(_hidden(teacher, b["tokens"]))
    for i in range(len(prompts)):
        labels = b["labels"][i]
        rkl = ref.divergence("reverse_kl", s_logits[i], t_logits[i], labels, 1.0)
        nll = torch.nn.functional.cross_entropy(t_logits[i], labels, ignore_index=IGNORE, reduction="sum")
        assert one["tokens"][i] == 6
        assert one["reverse_kl_sum"][i] == pytest.approx(float(rkl), rel=1e-4)
        assert one["teacher_nll_sum"][i] == pytest.approx(float(nll), rel=1e-4)
    # 3 ranks over 4 chunks of one prompt: rank r scores chunks r, r + 3; ranks 1 and 2 score a chunk again in the
    # last round (as many samplings and forwards as rank 0) and drop it; gathered, every rank has the one result
    calls, local = {}, {}
    for rank in range(3):
        def counted(chunk, rows, rank=rank):
            calls[rank] = calls.get(rank, 0) + 1
            return sample(chunk, rows)
        score_samples(student, teacher, prompts, counted, batch=1, pad_id=0, num_chunks=3, rank=rank, world=3,
                      gather=lambda mine, rank=rank: [local.setdefault(rank, mine)])  # keeps each rank's own
    assert calls == {0: 2, 1: 2, 2: 2} and sorted(k for mine in local.values() for k, _ in mine) == [0, 1, 2, 3]
    parts = [local[r] for r in range(3)]
    split = score_samples(student, teacher, prompts, sample, batch=1, pad_id=0, num_chunks=3, rank=0, world=3,
                          gather=lambda mine: [mine, *parts[1:]])
    assert split == alone
    summary = per_prompt_summary(one)
    assert summary["prompts"] == 4 and len(summary["per_prompt"]["reverse_kl"]) == 4
    assert summary["per_prompt"]["reverse_kl"][0] == pytest.approx(one["reverse_kl_sum"][0] / 6, abs=1e-6)
    assert summary["reverse_kl_mean"] == pytest.approx(sum(summary["per_prompt"]["reverse_kl"]) / 4)
    assert summary["teacher_nll_mean"] > 0 and student.training

def test_only_completion_tokens_carry_loss():
    """The gradient w.r.t. the student's logits is zero at every position whose next token is a prompt token or
    padding, and non-zero where the next token was sampled."""
    student, teacher = _model(1), _model(0)
    b = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        t_hidden = _hidden(teacher, b["tokens"])
        s_logits = student(b["tokens"])
    logits = s_logits.clone().requires_grad_(True)  # the loss's "hidden" = the logits, its head the identity
    parts = kd_and_ce(logits, torch.nn.Identity(), b["labels"], LiveTeacher(t_hidden, teacher.output),
                      build_kd_loss("reverse_kl"), 1.0, num_chunks=2)
    parts["loss"].backward()
    carries = logits.grad.abs().sum(-1) > 0
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        expected = [len(p) - 1 <= t < len(p) + len(c) - 1 for t in range(b["tokens"].shape[1])]
        assert carries[i].tolist() == expected, i


def test_on_policy_kd_loss_takes_the_kd_options_its_kind_reads():
    kd = OmegaConf.create({"loss": "jsd", "temperature": 2.0, "beta": 0.3, "alpha": None, "ratio": None})
    assert on_policy_kd_loss(OnPolicySettings(), kd) == build_kd_loss("reverse_kl", 2.0)
    assert on_policy_kd_loss(OnPolicySettings(loss="jsd"), kd) == build_kd_loss("jsd", 2.0, beta=0.3)
    assert set(KD_LOSSES) == set(ref.KINDS)
