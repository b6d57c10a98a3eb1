"""Where the fp8 teacher's drift comes from, on a CPU: torchao's fp8 rowwise recipe emulated (issue 19).

    python bench/fp8_drift_cpu.py [--batches 4] [--model DIR]

fp8 matmuls need an sm89+ GPU, so this emulates `teacher.quantize=fp8` (torchao's float8 dynamic activation /
float8 weight with per-row scales) in fp32: each activation row and each weight output row is scaled by its amax
to e4m3's range (448), rounded to float8_e4m3fn and scaled back; the product accumulates in fp32, as the fp8
kernels do. Prints one JSON line per variant: mean KL(fp32 teacher || emulated fp8 teacher) in nats per token and
top-1 agreement, over the shipped transfer passages packed to 512 tokens (the data KD trains on). Variants keep a
set of projections in full precision, or round only the weights or only the activations; the `head` variants
round the output projection too (the teacher's fp8 leaves it in the run dtype: these say what that is worth); the
`tensorwise` variants use one scale per tensor instead of per row (bench/fp8_granularity_speed.py times them).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from llm_recipe.components.assets import embedded_model_dir
from llm_recipe.components.data.dataset import build_dataset, build_loader
from llm_recipe.components.models import load_model
from llm_recipe.components.models.tokenizer import Tokenizer
from llm_recipe.components.quantization.fp8_drift import e4m3_rows
from llm_recipe.components.training import hidden_states


def e4m3_rowwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to e4m3 with one amax scale per row along `dim` (teacher.max_drift's rounding), back in fp32."""
    values, scale = e4m3_rows(x, dim)
    return values.float() * scale


def e4m3_tensorwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to e4m3 with one amax scale for the whole tensor (torchao's PerTensor granularity), in fp32."""
    scale = (x.abs().amax() / 448.0).float().clamp_min(1e-12)
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def int8_rowwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to symmetric int8 with one amax scale per row along `dim`, back in fp32."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 127.0
    return (x / scale).round().clamp(-127, 127) * scale


class EmulatedFp8Linear(nn.Module):
    """A frozen linear whose weight (per output row) and input (per token) are rounded as fp8 rowwise does
    (or, with `fmt="int8"`, as int8 dynamic-activation int8-weight does)."""

    def __init__(self, linear: nn.Linear, weights: bool, activations: bool, fmt: str = "e4m3") -> None:
        super().__init__()
        self.round = {"e4m3": e4m3_rowwise, "e4m3_tensor": e4m3_tensorwise, "int8": int8_rowwise}[fmt]
        w = linear.weight.detach().float()
        self.weight = self.round(w, 1) if weights else w
        self.bias = linear.bias
        self.activations = activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xin = self.round(x.float(), -1) if self.activations else x.float()
        y = F.linear(xin, self.weight)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


# name -> (projections kept in full precision, round weights, round activations); names as in the decoder layer
VARIANTS = {
    "all linears fp8": ((), True, True),
    "weights only": ((), True, False),
    "activations only": ((), False, True),
    "keep attention (q,k,v,o)": (("attn.",), True, True),
    "keep q,k": (("attn.q_proj", "attn.k_proj"), True, True),
    "keep gate (w1)": (("mlp.w1",), True, True),
    "keep up (w3)": (("mlp.w3",), True, True),
    "keep down (w2)": (("mlp.w2",), True, True),
    "keep gate+up": (("mlp.w1", "mlp.w3"), True, True),
    "keep the MLP": (("mlp.",), True, True),
    "tensorwise all linears": ((), True, True, "e4m3_tensor"),
    "tensorwise but down (w2)": (("mlp.w2",), True, True, "e4m3_tensor"),
    "int8 all linears": ((), True, True, "int8"),
    "int8 weights only": ((), True, False, "int8"),
    "int8 activations only": ((), False, True, "int8"),
}
# the output head (the logits KD reads) rounded as an fp8 linear: alone, and with every decoder linear
HEAD_VARIANTS = {"head only fp8": ("",), "all linears + head fp8": ()}


class EmulatedFp8Head(nn.Module):
    """The output projection (a plain or tied head's weight) computed from e4m3 rows of its input and weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = e4m3_rowwise(weight.detach().float(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(e4m3_rowwise(x.float(), -1), self.weight).to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batches", type=int, default=4, help="batches of 4 x 512 tokens")
    p.add_argument("--variants", default=",".join([*VARIANTS, *HEAD_VARIANTS]))
    a = p.parse_args()
    model_dir = a.model or str(embedded_model_dir())
    data = build_dataset(Tokenizer.from_dir(model_dir), source="transfer:passages", format="text", max_seq_len=512,
                         packed=True, use_chat_template=False, limit=None, shuffle=False)
    batches = []
    for batch in build_loader(data, 4, seed=0):
        batches.append(batch)
        if len(batches) >= a.batches:
            break

    def logprobs(model: nn.Module) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [torch.log_softmax(model.output(hidden_states(model, b)).float(), -1)[b["labels"] != -100]
                    for b in batches]

    reference, _ = load_model(model_dir, dtype=torch.float32)
    ref = logprobs(reference.eval())
    for name in a.variants.split(","):
        keep, weights, activations, *fmt = VARIANTS[name] if name in VARIANTS else (HEAD_VARIANTS[name], True, True)
        model, _ = load_model(model_dir, dtype=torch.float32)
        if name in HEAD_VARIANTS:  # a tied head (SmolLM2) reads the embedding's weight
            head = getattr(model.output, "tied_module", model.output)
            model.output = EmulatedFp8Head(head.weight)
        for layer in model.eval().layers:
            for fqn, mod in list(layer.named_modules()):
                if isinstance(mod, nn.Linear) and not fqn.startswith(keep or ("\0",)):
                    parent, _, attr = fqn.rpartition(".")
                    setattr(layer.get_submodule(parent) if parent else layer, attr,
                            EmulatedFp8Linear(mod, weights, activations, *fmt))
        kls, agree, n = [], 0, 0
        for lp_ref, lp_q in zip(ref, logprobs(model)):
            kls.append((lp_ref.exp() * (lp_ref - lp_q)).sum(-1))
            agree += int((lp_ref.argmax(-1) == lp_q.argmax(-1)).sum())
            n += lp_ref.shape[0]
        print(json.dumps({"variant": name, "tokens": n, "mean_kl_nats": round(float(torch.cat(kls).mean()), 4),
                          "top1_agreement": round(agree / n, 4)}), flush=True)


if __name__ == "__main__":
    main()
