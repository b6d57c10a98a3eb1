"""Our GGUF exports in real llama.cpp (through llama-cpp-python): the embedded SmolLM2-135M exported as F16,
Q8_0, Q4_0 and (quantized with torchao 8da4w first) Q4_0, then run by llama.cpp and by our model.

The reference for each file is our model running the weights that file stores (the GGUF dequantized back by
`convert_gguf_to_hf`). Three checks per file:
- **reading**: the file's weights re-exported as F32 and run by llama.cpp give our model's greedy continuations
  (16 tokens), its argmax at every prompt position and its logits to ~1e-2: tensor names, Q/K permutation, RoPE,
  norms, metadata and tokenizer ids are all read as we mean them (the F32 path has no rounding in llama.cpp).
- **packing** (Q8_0, Q4_0): the file is byte-identical to what llama.cpp's own quantizer
  (`llama_model_quantize`) makes of our F32 export, so llama.cpp runs it exactly as its own quantization.
- **the file itself**: llama.cpp's CPU kernels round activations (to f16 for F16 weights, to 8 bits per 32-block
  for Q8_0/Q4_0 weights), which moves a 135M model's logits by a few percent and flips near-tied greedy tokens;
  the relative L2 distance and the top-1 logit gap are bounded per type (docs/quantization.md has the numbers;
  `python tests/test_llama_cpp.py` prints them). F16 must also match continuations and argmax exactly.

Slow (4 exports and llama.cpp loads, a few minutes) and skipped without llama-cpp-python (not a dependency:
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
# The file itself in llama.cpp vs our model on the same weights: measured maxima (docs/quantization.md) with
# headroom. `top1`: |llama.cpp - ours| of the logit of our argmax; `rel_l2`: ||llama.cpp - ours|| / ||ours||.
TOLERANCE = {"F16": {"top1": 0.05, "rel_l2": 0.005}, "Q8_0": {"top1": 1.0, "rel_l2": 0.06},
             "Q4_0": {"top1": 1.0, "rel_l2": 0.12}, "8da4w-Q4_0": {"top1": 1.0, "rel_l2": 0.06}}
READING_TOP1 = 0.05  # F32 re-export of the file's weights: no rounding in llama.cpp but float summation order


def _ours(model, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """(prompt logits [T, V], greedy continuation) of our model."""
    from llm_recipe.components.models.generation import generate

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
    from llm_recipe.components.models import load_model
    from llm_recipe.components.quantization import quantize_model
    from llm_recipe.components.quantization.export_gguf import export_gguf

    model, args = load_model(embedded)
    model.eval()
    if kind == "8da4w-Q4_0":
        quantize_model(model, "8da4w", group_size=32)
        return export_gguf(model, args, embedded, tmp / f"{kind}.gguf", "Q4_0"), model
    return export_gguf(model, args, embedded, tmp / f"{kind}.gguf", kind), None


def _file_model(path: Path, tmp: Path):
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.gguf_import import convert_gguf_to_hf

    model, _ = load_model(convert_gguf_to_hf(path, tmp / f"{path.stem}-hf"))
    return model.eval()


def _llm(path: Path):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=1, verbose=False)


def _same_as_llama_cpp_quantizer(ours: Path, f32: Path, qtype: str, tmp: Path) -> bool:
    """Whether llama.cpp's own quantizer turns our F32 export into exactly the bytes of our `qtype` export."""
    import ctypes

    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[qtype]
    theirs = tmp / f"{qtype}-by-llama.cpp.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0

    def tensors(p: Path) -> dict:
        return {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(p)).tensors}

    return tensors(ours) == tensors(theirs)


def measure(kind: str, embedded: Path, tmp: Path) -> dict[str, dict]:
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer
    from llm_recipe.components.quantization.export_gguf import export_gguf

    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_dir(embedded)
    path, torchao_model = _export(kind, embedded, tmp)
    weights = _file_model(path, tmp)
    f32 = export_gguf(weights, load_model(tmp / f"{path.stem}-hf")[1], tmp / f"{path.stem}-hf",
                      tmp / f"{kind}-weights-f32.gguf", "F32")
    results = {}
    for name, gguf_path, ref in [("reading (F32 of the file's weights)", f32, weights), ("file", path, weights),
                                 *([("file vs torchao 8da4w", path, torchao_model)] if torchao_model else [])]:
        llm = _llm(gguf_path)
        results[name] = compare(llm, ref, tokenizer)
        llm.close()
    if kind in ("Q8_0", "Q4_0"):
        model_f32 = export_gguf(*_load(embedded), embedded, tmp / "model-f32.gguf", "F32")
        results["packing"] = {"same_bytes_as_llama_cpp_quantizer": _same_as_llama_cpp_quantizer(
            path, model_f32, kind, tmp)}
    return results


def _load(embedded: Path):
    from llm_recipe.components.models import load_model

    model, args = load_model(embedded)
    return model.eval(), args


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TOLERANCE))
def test_llama_cpp_runs_our_gguf_like_our_model(kind, embedded_model_dir, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/quantization.md)")
    r = measure(kind, embedded_model_dir, tmp_path)
    reading = r["reading (F32 of the file's weights)"]
    assert reading["same_continuations"] == reading["prompts"] and reading["argmax"] == 1.0, reading
    assert reading["top1"] < READING_TOP1, reading
    if kind in ("Q8_0", "Q4_0"):
        assert r["packing"]["same_bytes_as_llama_cpp_quantizer"], r["packing"]
    f = r["file"]
    if kind == "F16":
        assert f["same_continuations"] == f["prompts"] and f["argmax"] == 1.0, f
    assert f["top1"] < TOLERANCE[kind]["top1"] and f["rel_l2"] < TOLERANCE[kind]["rel_l2"], f


if __name__ == "__main__":  # print the numbers for docs/quantization.md
    import tempfile

    from llm_recipe.components.assets import ensure_assets

    with tempfile.TemporaryDirectory() as d:
        for k in sys.argv[1:] or TOLERANCE:
            for ref, r in measure(k, ensure_assets(quiet=True), Path(d)).items():
                if "top1" not in r:
                    print(f"{k:11s} {ref}: {r}", flush=True)
                    continue
                print(f"{k:11s} {ref:36s} top1 {r['top1']:.4f}  argmax {r['argmax']:.3f}  "
                      f"rel_l2 {r['rel_l2']:.4f}  continuations {r['same_continuations']}/{r['prompts']}", flush=True)
