"""KV-cached generation equals recomputing the full sequence each step; sampling knobs behave."""

import pytest
import torch

from llm_recipe.components.models import ModelArgs, build_model
from llm_recipe.components.models.generation import generate, sample_next

ARGS = ModelArgs(family="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                 tie_word_embeddings=False, qkv_bias=False, o_bias=False)


def _model():
    torch.manual_seed(0)
    return build_model(ARGS).eval()


def test_cached_greedy_matches_full_recompute():
    model = _model()
    prompt = [3, 14, 15, 9, 2, 6]
    got = generate(model, prompt, max_new_tokens=12)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]
    # Caches are gone afterwards, so training-style forwards work again.
    assert not model.caches_are_enabled()
    model(torch.tensor([prompt]))


def test_stop_ids_and_streaming():
    model = _model()
    # Seeded sampling makes a varied but reproducible sequence; stop at a token that first appears at step k.
    first = generate(model, [1, 2, 3], max_new_tokens=8, temperature=2.0, seed=3)
    k = next(i for i in range(1, 8) if first[i] not in first[:i])
    streamed = []
    out = generate(model, [1, 2, 3], max_new_tokens=8, temperature=2.0, seed=3, stop_ids=[first[k]],
                   on_token=streamed.append)
    assert out == first[: k + 1] == streamed


def test_sampling_is_seeded_and_respects_top_k_top_p():
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0, -1.0])
    assert sample_next(logits) == 0
    picks = {sample_next(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(i))
             for i in range(200)}
    assert picks == {0, 1}
    # top_p 0.5: token 0 alone already has > 50% of the mass.
    assert {sample_next(logits, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(i)) for i in range(50)} == {0}
    model = _model()
    a = generate(model, [1, 2], 8, temperature=1.0, seed=7)
    b = generate(model, [1, 2], 8, temperature=1.0, seed=7)
    assert a == b


@pytest.mark.parametrize("n", [1, 3])
def test_max_new_tokens(n):
    assert len(generate(_model(), [4, 5], max_new_tokens=n)) == n


def test_batched_greedy_matches_one_prompt_at_a_time():
    from llm_recipe.components.models.generation import generate_batch

    model = _model()
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [7]]  # different lengths: left padding must not leak
    got = generate_batch(model, prompts, max_new_tokens=10, pad_id=0)
    assert got == [generate(model, p, max_new_tokens=10) for p in prompts]
    # A row stops at its own stop id (cut before it); the others run on.
    stop = got[1][4]
    cut = generate_batch(model, prompts, max_new_tokens=10, pad_id=0, stop_ids=[stop])
    for row, full in zip(cut, got):
        assert row == full[: full.index(stop)] if stop in full else row == full
    assert not model.caches_are_enabled()


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query heads, and one KV head per query head
def test_cached_attention_gives_torchtunes_scores_without_expanding_the_cache(monkeypatch, kv_heads):
    """Grouped heads with a KV cache attend as g x s query rows per KV head (builder.py's `_cached_attention`):
    every step's logits equal those of torchtune's forward, which copies the cache out to every query head."""
    import dataclasses

    from torchtune.modules import MultiHeadAttention

    from llm_recipe.components.models.builder import tune_layers
    from llm_recipe.components.models.generation import generate_batch

    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [7]]  # left padding: the mask matters in prefill and decode
    seen: dict[str, list[torch.Tensor]] = {"ours": [], "torchtune": []}

    def run(name: str) -> list[list[int]]:
        def pick(logits: torch.Tensor) -> torch.Tensor:
            seen[name].append(logits.clone())
            return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)  # varied tokens

        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(ARGS, num_kv_heads=kv_heads)).eval()
        return generate_batch(model, prompts, max_new_tokens=8, pad_id=0, pick=pick)

    calls = []
    ours = tune_layers().Attention._cached_attention
    monkeypatch.setattr(tune_layers().Attention, "_cached_attention",
                        lambda self, *a: calls.append(1) or ours(self, *a))
    got = run("ours")
    assert calls, "the decode did not take the grouped-head cache path"
    monkeypatch.setattr(tune_layers().Attention, "_cached_attention",
                        lambda self, x, y, mask, input_pos: MultiHeadAttention.forward(self, x, y, mask=mask,
                                                                                       input_pos=input_pos))
    assert run("torchtune") == got
    assert len(seen["ours"]) == 8
    for a, b in zip(seen["ours"], seen["torchtune"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_position_past_the_kv_cache_is_an_error():
    """The cache is written without torchtune's assert on a device value (a sync per layer and token): writing
    past its end still fails, in the index, rather than wrapping around or writing somewhere else."""
    model = _model()
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=8)
    mask = torch.ones(1, 8, 8, dtype=torch.bool).tril()
    with torch.no_grad():
        model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), input_pos=torch.arange(8)[None], mask=mask)
        with pytest.raises(IndexError, match="out of bounds"):
            model(torch.tensor([[5]]), input_pos=torch.tensor([[8]]), mask=mask[:, -1:])
    model.reset_caches()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: whether a cached forward waits for the GPU")
def test_a_cached_forward_never_waits_for_the_gpu():
    """Prefill and decode steps with the KV cache run without a device sync (torchtune's cache write asserted on a
    device value: a sync per layer and token of an eager decode)."""
    model = _model().cuda()
    with torch.device("cuda"):
        model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=8)
    mask = torch.ones(2, 8, 8, dtype=torch.bool, device="cuda").tril()
    tokens = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            model(tokens, input_pos=torch.arange(4, device="cuda").expand(2, 4), mask=mask[:, :4])
            for pos in range(4, 8):
                model(tokens[:, :1], input_pos=torch.full((2, 1), pos, device="cuda"), mask=mask[:, pos:pos + 1])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_prompt_forward_projects_only_each_rows_last_position():
    """A batch of prompts projects b positions to the vocabulary, not b x width: on-policy KD's 64 chat prompts of
    512 tokens held 17 GB of fp32 logits at a 128k vocabulary (a 10 GiB higher peak, measured on an H200)."""
    from llm_recipe.components.models.generation import generate_batch, last_logits

    model = _model()
    projected = []
    model.output.register_forward_hook(lambda mod, args, out: projected.append(args[0].shape[:-1].numel()))
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [7]]
    got = generate_batch(model, prompts, max_new_tokens=4, pad_id=0)
    assert projected == [3] * 4  # the prompts' forward and each decode step: one position per row
    assert got == [generate(model, p, max_new_tokens=4) for p in prompts]
    tokens = torch.tensor([[3, 14, 15, 9], [2, 6, 5, 3]])
    with torch.no_grad():
        assert torch.equal(last_logits(model, tokens), model(tokens)[:, -1])
    assert not model.skip_output  # restored


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens():
    """`compile_mode` (the transfer recipe's `compile: true` on a GPU) compiles the one-token step and pads the
    prompt width to a multiple of 64; greedy tokens and stop handling must not change."""
    from llm_recipe.components.models.generation import generate_batch

    model = _model()
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [7]]
    eager = generate_batch(model, prompts, max_new_tokens=20, pad_id=0)
    assert generate_batch(model, prompts, max_new_tokens=20, pad_id=0, compile_mode="default") == eager
    stop = eager[1][4]
    cut = generate_batch(model, prompts, max_new_tokens=20, pad_id=0, stop_ids=[stop], compile_mode="default")
    assert cut == [row[: row.index(stop)] if stop in row else row for row in eager]


@pytest.mark.parametrize("student", ["plain", "nf4", "qat"])
def test_compiled_decode_of_plain_nf4_and_qat_layers(student):
    """The compiled decode step compiles one plain layer and reuses it for every layer (a region) on torch >= 2.11;
    layers with an NF4 base or QAT fake quantizers, which Dynamo cannot trace through a region, compile unrolled:
    the same greedy tokens as eager decode either way (through a region, NF4 and QAT layers fail to compile)."""
    from llm_recipe.components.models import LoRASettings
    from llm_recipe.components.models.generation import _LAYER_REGION, generate_batch, layers_fit_a_region
    from llm_recipe.components.quantization import prepare_qat

    torch.manual_seed(0)
    # 256 wide: NF4 quantizes in blocks of 64 elements and its scalers in blocks of 256
    args = ModelArgs(**{**ARGS.__dict__, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
    lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), quantize_base="nf4")
    model = build_model(args, lora=lora if student == "nf4" else None).eval()
    if student == "qat":
        prepare_qat(model, "8da4w", 32)
    assert layers_fit_a_region(model) == (student == "plain" and _LAYER_REGION is not None)
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8]]
    with torch.no_grad():
        eager = generate_batch(model, prompts, max_new_tokens=6, pad_id=0)
        assert generate_batch(model, prompts, max_new_tokens=6, pad_id=0, compile_mode="default") == eager
    torch._dynamo.reset()


def test_batched_sampling_is_reproducible_and_honours_top_k():
    from llm_recipe.components.models.generation import generate_batch, sample_batch

    model = _model()
    prompts = [[1, 2, 3], [4, 5]]
    draw = lambda seed: generate_batch(model, prompts, 12, pad_id=0, temperature=1.5,  # noqa: E731
                                       generator=torch.Generator().manual_seed(seed))
    assert draw(1) == draw(1) != draw(2)
    logits = torch.randn(64, 61)
    picks = sample_batch(logits, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert all(int(p) in set(logits[i].topk(3).indices.tolist()) for i, p in enumerate(picks))
    assert torch.equal(sample_batch(logits), logits.argmax(-1))


def test_static_decode_pads_rows_and_width_and_keeps_its_caches():
    """StaticDecode (on-policy KD's compiled sampling): any number of prompts up to its batch runs at that batch
    and at a bucketed width, with the KV caches of the first call (same tensors, reset) and the model's attention
    layers left as torchtune built them; the tokens are the plain batched ones. Dynamo with the eager backend: the
    shapes and guards of torch.compile without Inductor's compile time."""
    from llm_recipe.components.models.generation import StaticDecode, generate_batch

    model = _model()
    static = StaticDecode(4, mode="default", backend="eager")
    assert [static.width(w) for w in (1, 64, 65, 200, 3000)] == [64, 64, 128, 256, 4096]
    assert StaticDecode(4, max_width=1000).width(90) == 128 and StaticDecode(4, max_width=100).width(200) == 200
    # the cap is exact: on-policy's max_width is max_seq_len - max_new_tokens (1000 - 16), and a prompt of 600 tokens
    # padded to 1024 made the sequence longer than the model's max_seq_len
    assert StaticDecode(4, max_width=984).width(600) == 984 and StaticDecode(4, max_width=100).width(90) == 100
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [7]]
    caches = None
    for n in (3, 1, 2, 3):
        got = generate_batch(model, prompts[:n], max_new_tokens=10, pad_id=0, static=static)
        (key,) = static._caches  # one cache length: 64 + 10
        ptrs = [c.k_cache.data_ptr() for c in static._caches[key]]
        assert caches is None or ptrs == caches
        caches = ptrs
        for layer in model.layers:  # as built: kv_cache None in the instance dict, not a child module
            assert layer.attn.__dict__["kv_cache"] is None and "kv_cache" not in layer.attn._modules
            assert not layer.attn.cache_enabled
        fresh = _model()  # the plain path (torchtune's delete_kv_caches leaves kv_cache a child module of None)
        assert got == generate_batch(fresh, prompts[:n], max_new_tokens=10, pad_id=0)
    assert key[:2] == (4, 74)
    with pytest.raises(ValueError, match="5 prompts for a StaticDecode of 4 rows"):
        generate_batch(model, prompts + prompts[:2], max_new_tokens=2, pad_id=0, static=static)
    stop = got[1][4]  # stop ids end rows as before; the padding rows never hold the loop open
    cut = generate_batch(model, prompts, max_new_tokens=10, pad_id=0, stop_ids=[stop], static=static)
    assert cut == generate_batch(model, prompts, max_new_tokens=10, pad_id=0, stop_ids=[stop])


def test_static_decode_runs_one_batch_shape_per_width():
    """With `max_tokens` (on-policy KD sampling several micro-batches' prompts at once), prompts of one width run
    at the most rows whose KV cache spans at most max_tokens positions (at most `batch`), however many there are:
    one shape, and one set of KV caches, per width bucket (each compiled once; a shape per prompt count compiled up
    to three per width); the tokens are still the plain batched ones."""
    from llm_recipe.components.models.generation import StaticDecode, generate_batch

    assert [StaticDecode(8, max_tokens=96).rows(1, t) for t in (12, 16, 24, 50, 97)] == [8, 6, 4, 1, 1]
    assert StaticDecode(8, max_tokens=96).rows(6, 16) == 6 and StaticDecode(5).rows(1, 1000) == 5
    with pytest.raises(ValueError, match="7 prompts for a StaticDecode of 6 rows"):
        StaticDecode(8, max_tokens=96).rows(7, 16)
    with pytest.raises(ValueError, match="need batch >= 1"):
        StaticDecode(0)
    model = _model()
    static = StaticDecode(6, mode="default", backend="eager", max_tokens=4 * 70)  # width 64 + 6 new tokens: 4 rows
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [7], [1, 2], [8, 8, 8], [4]]
    for n in (4, 1, 3, 2):
        got = generate_batch(model, prompts[:n], max_new_tokens=6, pad_id=0, static=static)
        assert got == generate_batch(_model(), prompts[:n], max_new_tokens=6, pad_id=0)
    assert [k[:2] for k in static._caches] == [(4, 70)]
    with pytest.raises(ValueError, match="5 prompts for a StaticDecode of 4 rows"):
        generate_batch(model, prompts[:5], max_new_tokens=6, pad_id=0, static=static)


def test_static_decode_shapes_of_every_width_share_one_kv_buffer_per_layer():
    """Prompts of several widths (chat prompts) each get a decode shape whose KV caches a recorded CUDA graph keeps;
    they are views of one buffer per layer, as long as the longest call allowed (max_tokens, or batch x
    (max_width + max_new_tokens)), so a run holds one set of caches, not one per width: the tokens are still the
    plain batched ones, call after call and width after width. A prompt longer than the bound gets caches of its
    own."""
    from llm_recipe.components.models.generation import StaticDecode, generate_batch

    assert StaticDecode(8, max_tokens=4096, max_width=100, max_new_tokens=28).kv_positions == 8 * 128
    assert StaticDecode(8, max_tokens=500, max_width=100, max_new_tokens=28).kv_positions == 500
    assert StaticDecode(8).kv_positions is None
    import dataclasses

    def model():  # room for prompts of two width buckets (64 and 128) and one longer than the bound
        torch.manual_seed(0)
        return build_model(dataclasses.replace(ARGS, max_position_embeddings=512)).eval()

    trained = model()
    static = StaticDecode(6, mode="default", backend="eager", max_tokens=400, max_new_tokens=6)
    short, long = [[3, 14, 15], [9, 2, 6], [7]], [[i % 60 + 1 for i in range(99)], [5] * 70]
    for prompts in (short, long, short[:2], long[:1], short):
        got = generate_batch(trained, prompts, max_new_tokens=6, pad_id=0, static=static)
        assert got == generate_batch(model(), prompts, max_new_tokens=6, pad_id=0)
    assert sorted(k[:2] for k in static._caches) == [(2, 134), (5, 70)]  # widths 128 and 64, 6 new tokens
    k = [[c.k_cache for c in caches] for caches in static._caches.values()]
    for a, b in zip(*k, strict=True):  # each layer: both shapes' caches start at the same address, k apart from v
        assert a.data_ptr() == b.data_ptr() and a.untyped_storage().nbytes() == 400 * a.shape[1] * a.shape[3] * 4
    assert next(iter(static._caches.values()))[0].v_cache.data_ptr() != k[0][0].data_ptr()
    got = generate_batch(trained, [[4] * 300], max_new_tokens=6, pad_id=0, static=static)  # 306 x 1 fits in 400
    assert got == generate_batch(model(), [[4] * 300], max_new_tokens=6, pad_id=0)
    own = StaticDecode(6, mode="default", backend="eager", max_tokens=200, max_new_tokens=6)
    got = generate_batch(trained, [[4] * 300], max_new_tokens=6, pad_id=0, static=own)  # 306 > 200: its own
    assert got == generate_batch(model(), [[4] * 300], max_new_tokens=6, pad_id=0) and not own._shared
