"""Export an 8da4w model to an ExecuTorch `.pte` (XNNPACK) with a static KV cache for token-by-token generation.

torchtune's `KVCache` tracks its fill level in a `cache_pos` buffer and asserts on it with a data-dependent
check, which `torch.export` cannot trace. Instead of re-writing attention, we keep torchtune's attention and
plug in `_StaticKVCache`: the same `update(k, v)` interface, but it writes at the caller's `input_pos` with
`index_copy_` (a traceable buffer mutation). The exported program is

    forward(tokens: int64 [1, s], input_pos: int64 [s]) -> logits fp32 [1, s, vocab],   1 <= s <= max_seq_len

Prefill passes positions 0..s-1, each decode step the next position; the cache lives in the program's mutable
buffers (zero-initialised in the file) between calls of one loaded method. A new prompt starts again at 0.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.atomic import atomic_write_bytes
from ..errors import RecipeError
from ..setup_log import SetupLog
from .ptq import quantize_model
from .schemes import _is_torchao_tensor

# Warnings torch.export / ExecuTorch 1.5.1 print during our export that a user can do nothing about, silenced
# only around our export calls (`_quiet_export`): torch's pytree deprecation, raised inside torch / ExecuTorch
# code (9 FutureWarning blocks per export), the note that we set `cache.positions` during export (by design), and
# ExecuTorch's advice to run InitializedMutableBufferPass on mutated buffers, which `export_pte` does.
_NOT_ACTIONABLE = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r".*assigned during export"),
    (UserWarning, r"Mutation on a buffer in the model is detected"),
)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Hide `_NOT_ACTIONABLE` warnings (by category and message) while the export runs; every other warning,
    and every error, still shows."""
    with warnings.catch_warnings():
        for category, message in _NOT_ACTIONABLE:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def require_executorch() -> None:
    """A RecipeError naming the extra to install when ExecuTorch is missing (`quantize` asks before any work)."""
    try:
        import executorch.exir  # noqa: F401
    except ImportError as e:
        raise RecipeError("exporting a .pte needs ExecuTorch: pip install -c .venv/constraints.txt "
                          "'llm-recipe[executorch]' "
                          f"(executorch==1.5.1; import failed: {e})") from None


def round_scales_like_xnnpack(model: nn.Module) -> int:
    """Round (in place) every group-wise int4/int8 weight scale to bf16, as XNNPACK stores them in a `.pte`.

    Gives the eager twin of an exported program: the remaining difference is kernel arithmetic only. Returns
    the number of weights changed. (On SmolLM2-135M 8da4w this rounding alone moves logits by ~20% rel. L2:
    the model is that sensitive; QAT does not remove it.)
    """
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        block = getattr(w, "block_size", None)
        if w is None or getattr(w, "qdata", None) is None or block is None or int(block[-1]) == w.shape[-1]:
            continue  # only per-group weights (XNNPACK's blockwise path) get bf16 scales
        with torch.no_grad():
            w.scale.copy_(w.scale.to(torch.bfloat16).to(w.scale.dtype))
        n += 1
    return n


class _StaticKVCache(nn.Module):
    """A fixed-size K/V buffer written at explicit positions (set by the wrapper before each call)."""

    def __init__(self, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (1, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.positions: torch.Tensor | None = None

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache.index_copy_(2, self.positions, k_val)
        self.v_cache.index_copy_(2, self.positions, v_val)
        return self.k_cache, self.v_cache

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()


class StaticCacheDecoder(nn.Module):
    """Our decoder plus static KV caches and a causal mask: `forward(tokens [1, s], input_pos [s])`."""

    def __init__(self, model: nn.Module, max_seq_len: int) -> None:
        super().__init__()
        if max_seq_len > model.max_seq_len:
            raise RecipeError(f"max_seq_len {max_seq_len} exceeds the model's RoPE table ({model.max_seq_len}); "
                              "rebuild the model with a larger max_seq_len")
        self.model = model
        self.max_seq_len = max_seq_len
        self.register_buffer("causal", torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).tril(),
                             persistent=False)
        dtype = next(p.dtype for p in model.parameters() if not _is_torchao_tensor(p))
        self.caches = []
        for layer in model.layers:
            attn = layer.attn
            cache = _StaticKVCache(attn.num_kv_heads, max_seq_len, attn.head_dim, dtype)
            attn.kv_cache = cache
            attn.cache_enabled = True
            self.caches.append(cache)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        for cache in self.caches:
            cache.positions = input_pos
        mask = self.causal[input_pos].unsqueeze(0)  # [1, s, max_seq_len]: cache slot j visible iff j <= pos
        out = self.model(tokens, mask=mask, input_pos=input_pos.unsqueeze(0))
        for cache in self.caches:
            cache.positions = None
        return out

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()


def export_pte(
    model: nn.Module,
    out_path: str | os.PathLike,
    max_seq_len: int = 128,
    group_size: int = 32,
    example_len: int = 4,
    log: SetupLog | None = None,
) -> Path:
    """Write an XNNPACK `.pte` of the 8da4w-quantized `model` (quantized here on a copy if it is not yet).

    The caller's model is not modified. Only batch size 1 is exported (on-device generation). With `log`, each of
    the export's three parts (tracing, XNNPACK lowering, the ExecuTorch program) says when it starts and how long
    it took: together they take minutes on a CPU."""
    def part(what: str) -> contextlib.AbstractContextManager:
        return log.phase(what) if log is not None else contextlib.nullcontext()

    require_executorch()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from torch.export import Dim, export

    if getattr(model, "skip_output", False):
        raise RecipeError("export_pte: model.skip_output is set; the exported program must return logits")
    if not 2 <= example_len <= max_seq_len:
        raise RecipeError(f"example_len must be in [2, max_seq_len={max_seq_len}], got {example_len}")
    kinds = {type(p).__name__ for p in model.parameters() if _is_torchao_tensor(p)}
    if kinds - {"IntxUnpackedToInt8Tensor"}:
        raise RecipeError(f"export_pte: only 8da4w models lower to XNNPACK here, this one has {sorted(kinds)} "
                          "weights; quantize with scheme 8da4w (or pass the float model)")
    model = copy.deepcopy(model).eval()
    if not kinds:
        quantize_model(model, "8da4w", group_size)
    round_scales_like_xnnpack(model)  # what XNNPACK would do anyway; keeps the file and its twin identical
    wrapper = StaticCacheDecoder(model, max_seq_len).eval()
    vocab = model.tok_embeddings.num_embeddings
    tokens = torch.randint(0, vocab, (1, example_len))
    seq = Dim("seq", min=1, max=max_seq_len)
    with torch.no_grad(), _quiet_export():
        with part("pte: tracing (torch.export)"):
            program = export(wrapper, (tokens, torch.arange(example_len)),
                             dynamic_shapes={"tokens": {1: seq}, "input_pos": {0: seq}}, strict=False)
        with part("pte: lowering to XNNPACK"):
            edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
        with part("pte: the ExecuTorch program"):
            # Zero-initialise the caches in the file: masked slots are multiplied by 0 in attention, and 0 * NaN
            # from uninitialised memory would still poison the output.
            et = edge.to_executorch(ExecutorchBackendConfig(
                passes=[InitializedMutableBufferPass(["k_cache", "v_cache"])]))
    out_path = Path(out_path)
    atomic_write_bytes(out_path, et.buffer)
    return out_path


class PteRunner:
    """Load a `.pte` with `executorch.runtime` and call it like the eager wrapper (prefill, then decode)."""

    def __init__(self, path: str | os.PathLike) -> None:
        require_executorch()
        from executorch.runtime import Runtime

        if not Path(path).is_file():
            raise RecipeError(f"{path}: no such .pte file")
        self._method = Runtime.get().load_program(str(path)).load_method("forward")

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self._method.execute([tokens.long(), input_pos.long()])[0]
