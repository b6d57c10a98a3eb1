"""Token generation with torchtune's KV cache: greedy or sampled (temperature, top-k, top-p), stop tokens,
and a per-token callback for streaming; `generate_batch` for many prompts at once, eager or with a compiled
decode step, and `StaticDecode` for a training loop that samples again and again from the weights it trains."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .tune import import_torchtune

if TYPE_CHECKING:
    from torchtune.modules.transformer import TransformerDecoder


def delete_kv_caches(model: TransformerDecoder) -> None:
    """Drop the KV caches `setup_caches` allocated (torchtune's `delete_kv_caches`)."""
    import_torchtune()
    from torchtune.modules.common_utils import delete_kv_caches as delete

    delete(model)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Pick the next token from the last position's logits `[v]` (greedy when temperature is 0)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > top_p  # keep the smallest set whose mass reaches top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: TransformerDecoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (),
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate up to `max_new_tokens` after `prompt`; stops after emitting a stop id. Returns new tokens."""
    device = model.tok_embeddings.weight.device
    total = len(prompt) + max_new_tokens
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    dtype = model.tok_embeddings.weight.dtype
    with device:  # torchtune allocates the cache buffers (and their positions) on the default device
        model.setup_caches(batch_size=1, dtype=dtype, decoder_max_seq_len=total)
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=device))
    out: list[int] = []
    try:
        pos = torch.arange(len(prompt), device=device)
        tokens = torch.tensor([list(prompt)], device=device)
        while True:
            logits = model(tokens, input_pos=pos[None], mask=causal[None, pos])
            nxt = sample_next(logits[0, -1], temperature, top_k, top_p, generator)
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if nxt in stop_ids or len(out) >= max_new_tokens:
                return out
            pos = pos[-1:] + 1
            tokens = torch.tensor([[nxt]], device=device)
    finally:
        delete_kv_caches(model)


def sample_batch(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token of each row from last-position logits `[b, v]` (greedy when temperature is 0). Returns `[b]`."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_batch(
    model: TransformerDecoder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    compile_mode: str | None = None,
    keep_stop: bool = False,
    pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_done: Callable[[torch.Tensor], bool] | None = None,
    static: StaticDecode | None = None,
) -> list[list[int]]:
    """Generate for a batch of prompts at once with one KV cache: prompts are left-padded, each row gets its own
    positions and a mask that hides its padding. Returns each row's new tokens, cut before its first stop id
    (`keep_stop`: just after it, the stop id included).
    `compile_mode` ("default", "reduce-overhead", ...): torch.compile the one-token decode step (static shapes:
    the batch, one token, the full mask width); None (and no `static`) runs everything eagerly, compiled layers too.
    `pick(logits [b, v]) -> [b]` replaces the sampling rule (temperature, top_k, top_p, generator are then unused);
    `all_done(done [b]) -> bool` replaces "every row has stopped" (several processes running one sharded model
    must agree on it, or their forward passes, and so their collectives, would differ in number).
    `static` (a `StaticDecode`, whose compiled step is used): the batch padded to `static.rows(...)` rows (extra
    rows start finished; `pick` sees them too), the width to `static.width(...)`, its KV caches reused, the prompt's
    forward run eagerly (see StaticDecode); `compile_mode` is then unused.

    Ours rather than `torchtune.generation.generate`: that one keeps every step's full logits
    (`[b, steps, vocab]`, tens of GB for a large batch) and finds padding by comparing token ids with `pad_id`.
    """
    import_torchtune()
    from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch: every prompt needs at least one token")
    device = model.tok_embeddings.weight.device
    real_rows, width = len(prompts), max(len(p) for p in prompts)
    if static is not None:  # one shape per width bucket: rows padded with one-token prompts that start finished
        width = static.width(width)
        prompts = [*prompts, *[[pad_id]] * (static.rows(real_rows, width + max_new_tokens) - real_rows)]
    elif compile_mode is not None:  # the compiled step's shapes follow the width: round it up to few distinct ones
        width = -(-width // 64) * 64
    b, total = len(prompts), width + max_new_tokens
    tokens = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((b, total), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        real[i, width - len(p):] = True  # prompt tokens and every generated position
    masks = get_causal_mask_from_padding_mask(real, target_seq_len=total)  # [b, total, total]
    positions = get_position_ids_from_padding_mask(real)  # [b, total]
    stops = torch.as_tensor(list(stop_ids) or [-1], device=device)
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    done[real_rows:] = True
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=device)
    decode = (_step_logits if static is None and compile_mode is None else
              _compiled_decode(static.mode if static is not None else compile_mode,
                               static.backend if static is not None else "inductor", layers_fit_a_region(model)))
    with contextlib.ExitStack() as stack:
        if static is None and compile_mode is None:  # eager means eager: layers compiled for training (on-policy
            # KD) would otherwise compile KV-cache variants, and the sizes they vary in would make Dynamo compile the
            # next training graph of that code for dynamic sizes
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        if static is not None:
            stack.enter_context(static.caches(model, total, b))
        else:
            with device:  # torchtune allocates the cache buffers (and their positions) on the default device
                model.setup_caches(batch_size=b, dtype=model.tok_embeddings.weight.dtype, decoder_max_seq_len=total)
            stack.callback(delete_kv_caches, model)
        with torch.compiler.set_stance("force_eager") if static is not None else contextlib.nullcontext():
            logits = last_logits(model, tokens, positions[:, :width], masks[:, :width])
        for t in range(max_new_tokens):
            nxt = sample_batch(logits, temperature, top_k, top_p, generator) if pick is None else pick(logits)
            out[:, t] = nxt
            hit = torch.isin(nxt, stops) & ~done
            lengths = torch.where(hit, t + int(keep_stop), lengths)
            done |= hit
            # whether every row has stopped costs a device sync: ask every 16 steps, not every step
            if t + 1 == max_new_tokens or (t % 16 == 15 and (bool(done.all()) if all_done is None else all_done(done))):
                break
            pos = width + t
            logits = decode(model, nxt[:, None], positions[:, pos : pos + 1], masks[:, pos : pos + 1])
    return [row[:n].tolist() for row, n in zip(out[:real_rows].cpu(), lengths[:real_rows].cpu().tolist())]


def last_logits(model: torch.nn.Module, tokens: torch.Tensor, input_pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's last-position logits [b, vocab] in fp32 (a prompt's forward, with or without a KV cache).

    A decoder that can return its normed hidden states (`skip_output`, models/builder.py) projects only that
    position to the vocabulary: b prompts of s tokens never hold [b, s, vocab] fp32 logits (64 chat prompts of
    512 tokens at Llama 3's 128,256 ids: 17 GB, most of on-policy KD's peak memory before)."""
    if not (hasattr(model, "skip_output") and callable(getattr(model, "output", None))):
        return model(tokens, input_pos=input_pos, mask=mask)[:, -1].float()
    prev, model.skip_output = model.skip_output, True
    try:
        hidden = model(tokens, input_pos=input_pos, mask=mask)
    finally:
        model.skip_output = prev
    return model.output(hidden[:, -1]).float()


def _step_logits(model: TransformerDecoder, tokens: torch.Tensor, input_pos: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """The logits of a one-token decode step [b, vocab] (the model's forward with the KV cache): what
    `_compiled_decode` compiles, so it leaves `skip_output` alone (a module attribute Dynamo would guard on)."""
    return model(tokens, input_pos=input_pos, mask=mask)[:, -1]


def _decode_layer(layer: torch.nn.Module, h: torch.Tensor, mask: torch.Tensor,
                  input_pos: torch.Tensor) -> torch.Tensor:
    return layer(h, mask=mask, input_pos=input_pos)


def _region(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """`fn` compiled once and reused for every identical decoder layer it is called on (Dynamo traces one layer,
    Inductor compiles it once), not unrolled 16-32 times into one graph: a 16-layer decode step's first call took
    22-25 s instead of 42 s on 2 CPU cores with torch 2.13, 32 s instead of 45 s with torch 2.11 (session 55, an
    empty Inductor cache each), the same samples; on one H200 (Llama-1B shape, batch 32, CUDA graphs) 11.1-12.4 s
    instead of 19.8-20.3 s, for a decode step 1.3% slower (a layer's boundary is no longer fused across: session
    56). None before torch 2.11 (nested_compile_region came in 2.8; not tried here)."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region(fn) if region is not None and version >= (2, 11) else None


def _step_logits_by_layer(model: TransformerDecoder, tokens: torch.Tensor, input_pos: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """`_step_logits` with each layer through `_region(_decode_layer)`: torchtune's TransformerDecoder.forward
    for one token with the KV cache (embedding, layers, norm, head in fp32), spelled out so the layer call can be a
    region."""
    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        h = _LAYER_REGION(layer, h, mask, input_pos)
    return model.output(model.norm(h)).float()[:, -1]


_LAYER_REGION = _region(_decode_layer)  # None: no region on this torch


def layers_fit_a_region(model: torch.nn.Module) -> bool:
    """Whether the decode step can compile `model`'s layers as one region: this torch has it, and every layer
    holds plain tensors and no QAT fake quantizer. Dynamo (torch 2.11-2.13) traces neither a tensor-subclass weight
    (an NF4 or fp8 base: "no rule registered for HOP invoke_subgraph and subclass") nor a fake quantizer, which
    sets tensors on itself in forward, through a region; those models compile unrolled, as before."""
    if _LAYER_REGION is None:
        return False
    for layer in getattr(model, "layers", ()):
        if any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in layer.parameters()):
            return False
        if any(getattr(m, a, None) is not None for m in layer.modules()
               for a in ("activation_fake_quantizer", "weight_fake_quantizer")):
            return False
    return True


def decode_capacity(total: int, max_rows: int, max_tokens: int | None) -> int:
    """The most prompts of `total` positions (prompt width + new tokens) one decode batch takes: `max_rows`, fewer
    where their KV cache would span more than `max_tokens` positions (at least one)."""
    if max_tokens is None:
        return max_rows
    return min(max_rows, max(1, max_tokens // total))


@functools.cache
def _compiled_decode(mode: str, backend: str = "inductor", by_layer: bool = False) -> Callable[..., torch.Tensor]:
    """One compiled decode step per mode, backend, layer region (`layers_fit_a_region`) and process (compiling it
    again per call would recompile)."""
    return torch.compile(_step_logits_by_layer if by_layer else _step_logits,
                         mode=None if mode == "default" else mode, dynamic=False, backend=backend)


class StaticDecode:
    """What lets a training loop sample with a compiled decode step again and again (on-policy KD) without
    compiling or recording it again: every `generate_batch(..., static=this)` call has the same shapes and the
    same KV-cache tensors, so the step compiles once per width bucket and its CUDA graph (`mode`
    "reduce-overhead") is recorded once and then replayed.

    - `rows(n, total)`: a call of n prompts with `total` positions (padded prompt width + new tokens) runs
      `decode_capacity` rows, a function of `total` alone (the rest are one-token rows that start finished): one
      batch shape per width, so each width's step is compiled and recorded once (padded to 16 x 2^k rows instead,
      on-policy KD's groups of chat prompts compiled up to three shapes per width, 20 s each on an H200).
    - `width(w)`: the prompt width rounded up to 64 x a power of two (64, 128, 256, ...), at most `max_width` (the
      longest prompt the model's max_seq_len leaves room for, never rounded past it): a few shapes for prompts of
      any length.
    - `caches(model, total, rows)`: one set of torchtune KV caches per cache shape, made on first use, reset in
      place before each call (the same addresses every time, which a recorded CUDA graph needs), attached to the
      model's attention layers only while it generates. Outside that, the model's attention layers hold
      `kv_cache = None` exactly as before, so a training forward through separately compiled layers sees what it
      was compiled for. With `max_tokens` (or `max_width` and `max_new_tokens`), every shape's caches are views of
      one buffer per layer of `kv_positions` positions (calls run one at a time), not a set of buffers per shape
      each kept alive for the graphs recorded on it.

    The model's weights are whatever it holds at the call: a training model's own parameters, updated in place by
    its optimizer (a CUDA graph reads them at their addresses). The prompt's forward runs eagerly (under
    `torch.compiler.set_stance("force_eager")`), so layers compiled for training (`nn.Module.compile`) never
    compile a KV-cache variant; the decode step, compiled as one function over the whole model, traces those
    layers' code into its own graph (one layer compiled, reused for every identical one: `_decode_layer`) and
    leaves their compiled entries alone."""

    def __init__(self, batch: int, mode: str = "reduce-overhead", max_width: int | None = None,
                 backend: str = "inductor", max_tokens: int | None = None,
                 max_new_tokens: int | None = None) -> None:
        if batch < 1:
            raise ValueError(f"StaticDecode: need batch >= 1, got {batch}")
        self.batch, self.mode, self.max_tokens = batch, mode, max_tokens
        self.backend = backend  # "eager" in tests (Dynamo's guards, no Inductor)
        self.max_width = max_width  # exact: rounded up, prompt + new tokens could pass the model's max_seq_len
        # the most KV positions a call's caches span (rows x total), where it is known in advance: max_tokens bounds
        # rows x total (unless one prompt alone is longer), and no call is wider than max_width + max_new_tokens
        bounds = [max_tokens] if max_tokens is not None else []
        if max_width is not None and max_new_tokens is not None:
            bounds.append(batch * (max_width + max_new_tokens))
        self.kv_positions = min(bounds) if bounds else None
        self._caches: dict[tuple, list[torch.nn.Module]] = {}
        self._shared: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (dtype, device): per layer (k, v)

    def rows(self, n: int, total: int) -> int:
        """The padded batch for `n` prompts of `total` positions each."""
        rows = decode_capacity(total, self.batch, self.max_tokens)
        if n > rows:
            raise ValueError(f"generate_batch: {n} prompts for a StaticDecode of {rows} rows")
        return rows

    def width(self, width: int) -> int:
        """The padded prompt width for prompts of up to `width` tokens."""
        bucket = 64
        while bucket < width:
            bucket *= 2
        return bucket if self.max_width is None else max(width, min(bucket, self.max_width))

    @contextlib.contextmanager
    def caches(self, model: TransformerDecoder, total: int, rows: int | None = None) -> Iterator[None]:
        """The model's attention layers use this decoder's KV caches of `rows` (default `batch`) x `total` positions
        (reset) while inside."""
        import_torchtune()
        from torchtune.modules.kv_cache import KVCache

        attns = [layer.attn for layer in model.layers]
        if any(a.kv_cache is not None for a in attns):
            raise RuntimeError("StaticDecode: the model already has KV caches set up")
        weight = model.tok_embeddings.weight
        rows = rows or self.batch
        key = (rows, total, weight.dtype, weight.device)
        if key not in self._caches:
            if self.kv_positions is not None and rows * total <= self.kv_positions:
                self._caches[key] = self._views(attns, rows, total, weight)
            else:  # no bound known, or one prompt longer than the bound: caches of its own
                with weight.device:
                    self._caches[key] = [KVCache(rows, total, a.num_kv_heads, a.head_dim, weight.dtype)
                                         for a in attns]
        # where `kv_cache = None` lives: the instance dict (torchtune's __init__) or, after torchtune's
        # delete_kv_caches, the child modules; compiled code guards on that path, so it is put back as it was
        child = ["kv_cache" in a._modules for a in attns]
        for attn, cache in zip(attns, self._caches[key], strict=True):
            cache.reset()
            attn.kv_cache, attn.cache_enabled = cache, True
        try:
            yield
        finally:
            for attn, was_child in zip(attns, child, strict=True):
                del attn.kv_cache
                if was_child:
                    attn._modules["kv_cache"] = None
                else:
                    attn.kv_cache = None
                attn.cache_enabled = False

    def _views(self, attns: list[torch.nn.Module], rows: int, total: int,
               weight: torch.Tensor) -> list[torch.nn.Module]:
        """torchtune KV caches of `rows` x `total` positions whose K and V are the first rows x total positions of
        this decoder's shared per-layer buffers (allocated, zeroed, on first use at `kv_positions` positions)."""
        from torchtune.modules.kv_cache import KVCache

        shared = self._shared.get((weight.dtype, weight.device))
        if shared is None:
            shared = [tuple(torch.zeros(self.kv_positions * a.num_kv_heads * a.head_dim, dtype=weight.dtype,
                                        device=weight.device) for _ in range(2)) for a in attns]  # K, V
            self._shared[(weight.dtype, weight.device)] = shared
        caches = []
        for attn, (k, v) in zip(attns, shared, strict=True):
            shape = (rows, attn.num_kv_heads, total, attn.head_dim)
            with torch.device("meta"):  # torchtune's own buffers, never allocated: replaced by the views below
                cache = KVCache(rows, total, attn.num_kv_heads, attn.head_dim, weight.dtype)
            n = rows * attn.num_kv_heads * total * attn.head_dim
            cache.k_cache, cache.v_cache = k[:n].view(shape), v[:n].view(shape)
            cache.cache_pos = torch.arange(total, device=weight.device)
            caches.append(cache)
        return caches
