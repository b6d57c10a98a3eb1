"""Every model variant a shipped config trains compiles each decoder layer into whole graphs, with no graph break.

A graph break inside a layer leaves Python running between compiled pieces for every linear: the step becomes
host-bound (torchao's per-token activation quantizer did this on torch 2.11 and made a QAT step 1.4-1.6x a plain
one). Dynamo's decision to break does not depend on the device, so the CPU run checks it on whatever torch is
installed; on a GPU the same variants run there too.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.quantization import prepare_qat

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def args() -> ModelArgs:
    return ModelArgs(family="llama", vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False)


VARIANTS = {  # name: (lora section, QAT scheme): what the shipped GPU configs build
    "full": (None, None),
    "lora": (LoRASettings(rank=8, alpha=16.0, targets=TARGETS), None),
    "dora": (LoRASettings(rank=8, alpha=16.0, targets=TARGETS, use_dora=True), None),
    "qlora_nf4": (LoRASettings(rank=8, alpha=16.0, targets=TARGETS, quantize_base="nf4"), None),
    "qat_8da4w": (None, "8da4w"),
    "qat_lora_8da4w": (LoRASettings(rank=8, alpha=16.0, targets=TARGETS), "8da4w"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_layers_have_no_graph_break(variant, device):
    lora, qat = VARIANTS[variant]
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(args(), lora=lora, max_seq_len=64)
    if lora is not None:
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n or "magnitude" in n)
    if qat is not None:
        prepare_qat(model, qat, group_size=32)
    torch._dynamo.reset()
    counters.clear()
    for layer in model.layers:
        layer.compile(backend="aot_eager")  # Dynamo + AOTAutograd: where graphs break and subclasses flatten
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(2):  # the second call runs the cached graphs (and would show a recompile per layer)
        model(tokens).float().logsumexp(-1).mean().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
