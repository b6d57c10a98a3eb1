"""A frozen teacher's input embedding table kept in host memory: it only serves one row lookup per token, yet an
8B teacher's table (Llama 3.1 8B: 128256 x 4096 bf16, 0.98 GiB, untied from its head) would sit in GPU memory.

The rows of a micro-batch are gathered on the host from the batch's CPU tokens (`batch_to_device` keeps them as
`host_tokens`: no device-to-host copy, which would sync the host with the GPU every micro-batch) into a pinned
staging buffer, and copied to the GPU asynchronously. The lookup is exact (a gather: the same rows, no rounding).
Applied automatically by `prepare_teacher` (components/runtime.py) when it fits: a frozen teacher on CUDA, one
full copy per process (not FSDP-sharded), its embedding not tied to its output head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

HOST_TOKENS = "host_tokens"  # the batch key of the tokens' CPU copy (components/models/attention.py)


class HostEmbedding(nn.Module):
    """A frozen embedding whose table stays on the host; returns the rows of `tokens` on `device`.

    Staging, and why two buffers: the copy to the GPU is asynchronous (non_blocking from pinned memory), so a
    staging buffer must not be rewritten until the GPU has read it. The host runs ahead of the GPU (one host sync
    per optimizer step), so micro-batch i+1's rows are gathered while micro-batch i's copy may still be queued.
    Two buffers alternate, each with a CUDA event recorded after its copy; before a buffer is rewritten the host
    waits on its event, i.e. for the copy of two lookups ago, which lets the host stay up to two micro-batches
    ahead of the GPU (never a drain of the GPU's queue)."""

    SLOTS = 2

    def __init__(self, weight: Tensor, device: torch.device) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        # The gather reads the table on the host, so the table itself is ordinary (pageable) memory: pinning it
        # would lock ~1 GiB per process for nothing; only the staging buffers, which the GPU copies from, are pinned.
        host = torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
        host.copy_(weight.detach())
        self.weight = nn.Parameter(host, requires_grad=False)  # same state-dict key as nn.Embedding
        self.device = device
        self._staging: list[Tensor | None] = [None] * self.SLOTS
        self._events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._slot = 0

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, on the host, output on {self.device}"

    @torch.compiler.disable  # host work and events: always eager, even inside a whole-model torch.compile
    @torch.no_grad()
    def forward(self, tokens: Tensor) -> Tensor:
        """Rows of `tokens` (CPU tokens: no sync; device tokens: one device-to-host copy first) on `device`."""
        if self.weight.device.type != "cpu":  # moved back to a device by someone: an ordinary lookup there
            return nn.functional.embedding(tokens.to(self.weight.device), self.weight)
        if tokens.device.type != "cpu":
            # No host copy of these tokens: one device-to-host copy, which waits for the GPU (a sync).
            tokens = tokens.cpu()
        n, dim = tokens.numel(), self.embedding_dim
        staged = self._stage(n)
        torch.index_select(self.weight, 0, tokens.reshape(-1), out=staged)
        out = torch.empty((*tokens.shape, dim), dtype=self.weight.dtype, device=self.device)
        out.view(n, dim).copy_(staged, non_blocking=True)  # async from pinned memory on CUDA; a plain copy on CPU
        if self.device.type == "cuda":
            if self._events[self._slot] is None:
                self._events[self._slot] = torch.cuda.Event()
            self._events[self._slot].record(torch.cuda.current_stream(self.device))
        self._slot = (self._slot + 1) % self.SLOTS
        return out

    def _stage(self, n: int) -> Tensor:
        """This slot's staging buffer for `n` rows, once the copy that last read it is done."""
        event = self._events[self._slot]
        if event is not None:
            event.synchronize()  # waits for that copy only (issued two lookups ago), not for the whole queue
        buf = self._staging[self._slot]
        if buf is None or buf.shape[0] < n:
            # Allocated outside inference mode: the teacher runs under it, and an inference tensor could not be
            # written later outside it.
            with torch.inference_mode(False):
                buf = torch.empty((n, self.embedding_dim), dtype=self.weight.dtype,
                                  pin_memory=self.device.type == "cuda")
            self._staging[self._slot] = buf
        return buf[:n]


def embedding_on_host(model: nn.Module) -> bool:
    """Whether `model`'s input embedding is a `HostEmbedding` (its forward then wants the batch's CPU tokens)."""
    return isinstance(getattr(model, "tok_embeddings", None), HostEmbedding)


def input_tokens(model: nn.Module, batch: dict) -> Tensor:
    """The tokens to call `model` with: the batch's host copy when its embedding is on the host, else `tokens`."""
    if embedding_on_host(model):
        return batch.get(HOST_TOKENS, batch["tokens"])
    return batch["tokens"]


def why_not_on_host(model: nn.Module, device: torch.device) -> str | None:
    """None when `model`'s embedding can move to the host; else why not (CPU run, trainable, sharded, tied)."""
    if device.type != "cuda":
        return "not a CUDA run"
    from .builder import is_sharded, output_weight

    embed = getattr(model, "tok_embeddings", None)
    if type(embed) is not nn.Embedding:
        return "no plain nn.Embedding"
    if any(p.requires_grad for p in model.parameters()):
        return "not frozen"
    if is_sharded(model):
        return "sharded"
    if output_weight(model) is embed.weight:
        return "tied to the output head"
    return None


def move_embedding_to_host(model: nn.Module, device: torch.device) -> float:
    """Replace `model.tok_embeddings` by a `HostEmbedding` whose rows come out on `device`; returns the GiB the
    table took where it was (freed there once the old module is gone)."""
    embed = model.tok_embeddings
    moved = embed.weight.numel() * embed.weight.element_size() / 2**30
    model.tok_embeddings = HostEmbedding(embed.weight, device)
    return moved


def teacher_embedding_to_host(model: nn.Module, device: torch.device, log: bool) -> bool:
    """Keep a frozen teacher's input embedding on the host when it applies (`why_not_on_host`), saying so once
    when `log`; True when moved. A no-op on CPU runs and for tied or sharded teachers."""
    if why_not_on_host(model, device) is not None:
        return False
    gib = move_embedding_to_host(model, device)
    if log:
        print(f"teacher embeddings: on the host ({gib:.2f} GiB of GPU memory saved)", flush=True)
    return True
