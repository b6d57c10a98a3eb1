"""Our GGUF exports in real llama.cpp (through llama-cpp-python): the embedded SmolLM2-135M exported as F16,
Q8_0, Q4_0 and (quantized with torchao 8da4w first) Q4_0, then run by llama.cpp and by our model.

The reference for each file is our model running the weights that file stores (the GGUF dequantized back by
`convert_gguf_to_hf`), so what is compared is llama.cpp's runtime on our file: tensor names, Q/K permutation,
RoPE, norms, metadata, tokenizer ids. For 8da4w the torchao model itself (int8 dynamic activations) is
compared too. Checked per prompt: the greedy continuation (16 tokens), the argmax at every prompt position,
and the logit of our top-1 token. llama.cpp's CPU kernels round activations (to f16 for F16 weights, to 8-bit
per 32-block for Q8_0/Q4_0), so the tolerances grow with the type; docs/quantization.md has the measured
numbers (`python tests/test_llama_cpp.py` prints them).

Slow (4 exports and llama.cpp loads, ~1-2 minutes) and skipped without llama-cpp-python (not a dependency:
it builds llama.cpp from source; see docs/quantization.md for the install command).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 16
# Measured maxima (docs/quantization.md) with headroom; `top1`: |llama.cpp - ours| of the logit of our argmax.
TOLERANCE = {"F16": 0.05, "Q8_0": 0.25, "Q4_0": 0.35, "8da4w-Q4_0": 0.35}


def _ours(model, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """(prompt logits [T, V], greedy continuation) of our model."""
    from components.models.generation import generate

    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float().numpy()
        cont = generate(model, ids, NEW_TOKENS)
    return logits, cont


def _llama_cpp(llm, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """(prompt logits [T, V], greedy continuation) of llama.cpp, token by token from the same ids."""
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    cont: list[int] = []
    for _ in range(NEW_TOKENS):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        cont.append(nxt)
        llm.eval([nxt])
    return logits, cont


def compare(llm, model, tokenizer) -> dict:
    """Worst case over PROMPTS: top-1 logit difference, argmax agreement, rel. L2, equal continuations."""
    out = {"top1": 0.0, "argmax": 1.0, "rel_l2": 0.0, "same_continuations": 0, "prompts": len(PROMPTS)}
    for text in PROMPTS:
        ids = tokenizer.encode(text, add_bos=False)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids  # same tokenizer in the file
        (ours, c_ours), (theirs, c_theirs) = _ours(model, ids), _llama_cpp(llm, ids)
        top = ours.argmax(-1)
        rows = np.arange(len(ids))
        out["top1"] = max(out["top1"], float(np.abs(theirs[rows, top] - ours[rows, top]).max()))
        out["argmax"] = min(out["argmax"], float((theirs.argmax(-1) == top).mean()))
        out["rel_l2"] = max(out["rel_l2"], float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)))
        out["same_continuations"] += c_ours == c_theirs
    return out


def _export(kind: str, embedded: Path, tmp: Path) -> tuple[Path, object | None]:
    """(GGUF path, the torchao model for 8da4w else None)."""
    from components.models import load_model
    from components.quantization import quantize_model
    from components.quantization.export_gguf import export_gguf

    model, args = load_model(embedded)
    model.eval()
    if kind == "8da4w-Q4_0":
        quantize_model(model, "8da4w", group_size=32)
        return export_gguf(model, args, embedded, tmp / f"{kind}.gguf", "Q4_0"), model
    return export_gguf(model, args, embedded, tmp / f"{kind}.gguf", kind), None


def _file_model(path: Path, tmp: Path):
    from components.models import load_model
    from components.models.gguf_import import convert_gguf_to_hf

    model, _ = load_model(convert_gguf_to_hf(path, tmp / f"{path.stem}-hf"))
    return model.eval()


def measure(kind: str, embedded: Path, tmp: Path) -> dict[str, dict]:
    from llama_cpp import Llama

    from components.models.tokenizer import Tokenizer

    torch.set_num_threads(1)
    path, torchao_model = _export(kind, embedded, tmp)
    llm = Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=1, verbose=False)
    tokenizer = Tokenizer.from_dir(embedded)
    results = {"file weights": compare(llm, _file_model(path, tmp), tokenizer)}
    if torchao_model is not None:
        results["torchao 8da4w"] = compare(llm, torchao_model, tokenizer)
    llm.close()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TOLERANCE))
def test_llama_cpp_runs_our_gguf_like_our_model(kind, embedded_model_dir, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/quantization.md)")
    r = measure(kind, embedded_model_dir, tmp_path)["file weights"]
    assert r["same_continuations"] == r["prompts"], r
    assert r["argmax"] == 1.0, r
    assert r["top1"] < TOLERANCE[kind], r


if __name__ == "__main__":  # print the numbers for docs/quantization.md
    import tempfile

    from components.assets import ensure_assets

    with tempfile.TemporaryDirectory() as d:
        for k in sys.argv[1:] or TOLERANCE:
            for ref, r in measure(k, ensure_assets(quiet=True), Path(d)).items():
                print(f"{k:11s} vs {ref:14s} top1 {r['top1']:.4f}  argmax {r['argmax']:.3f}  "
                      f"rel_l2 {r['rel_l2']:.4f}  continuations {r['same_continuations']}/{r['prompts']}")
