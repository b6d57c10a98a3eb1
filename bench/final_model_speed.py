"""The final model/ of a run over several processes: streamed as each tensor is gathered (now) vs gathered to rank
0's host first (before session 51), on the same sharded model, in one launch.

The model is loaded and sharded as `recipe run lora|full` does (`load_model` on `Runtime.build_device`,
`prepare_model`: FSDP2 over the ranks). Then, each timed on every rank from one barrier to the next:

- `streamed`: `write_final_model` as the recipes call it: every rank gathers one tensor at a time on its GPU
  (`Runtime.gathered_state_dict`), LoRA merged there, rank 0 streams it to the file (stream_save);
- `host`: what it replaced: `Runtime.full_state_dict` (every tensor gathered, rank 0 keeps a CPU copy), then rank 0
  merges on the host and writes (`save_model` from that copy, the PEFT adapter from it).

`host_peak_gb_*`: rank 0's peak resident memory growth during each (sampled, checkpoint_speed.PeakRss). The two
model/ folders are compared byte for byte (`same_bytes`).

    torchrun --standalone --nproc-per-node 2 bench/final_model_speed.py --model /tmp/kdb/qwen_7b --lora \
        [--quantize-base nf4] --out /tmp/final_speed

One JSON line from rank 0.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from checkpoint_speed import PeakRss, parser, qwen_lora  # bench/: the same options


def main() -> None:
    p = parser(__doc__, "/tmp/final_speed")
    p.add_argument("--quantize-base", default=None, choices=("nf4", "fp8"), help="lora.quantize_base")
    a = p.parse_args()

    from llm_recipe.components.models import load_model, save_model, save_peft_adapter
    from llm_recipe.components.models.loader import lazily_merged_state_dict
    from llm_recipe.components.runtime import setup_runtime
    from llm_recipe.components.training import freeze_all_but_adapters, write_final_model

    rt = setup_runtime(a.device, "bf16", 0)
    lora = qwen_lora(a.lora, a.quantize_base or False)
    model, args = load_model(a.model, dtype=rt.dtype, device=rt.build_device(a.model), lora=lora)
    if lora is not None:
        freeze_all_but_adapters(model)
    rt.prepare_model(model)
    if rt.is_main:
        shutil.rmtree(a.out, ignore_errors=True)
        a.out.mkdir(parents=True)
    seconds = {}

    def timed(name, fn) -> None:
        rt.barrier()
        t = time.perf_counter()
        fn()
        rt.barrier()
        seconds[name] = round(time.perf_counter() - t, 2)

    with PeakRss() as streamed:
        timed("streamed", lambda: write_final_model(a.out / "streamed", rt, model, args, a.model, lora=lora))

    def host() -> None:  # session 50's write_final_model for several processes
        full = rt.full_state_dict(model)
        if rt.is_main:
            save_model(model, args, a.out / "host" / "model", a.model, state_dict=lazily_merged_state_dict(model, full))
            if lora is not None:
                save_peft_adapter(full, lora, a.out / "host" / "adapter")

    with PeakRss() as gathered:
        timed("host", host)
    if rt.is_main:
        def digest(d: Path) -> dict[str, str]:
            return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.safetensors"))}

        same = {sub: digest(a.out / "streamed" / sub) == digest(a.out / "host" / sub)
                for sub in ("model", "adapter") if (a.out / "host" / sub).is_dir()}
        size = sum(f.stat().st_size for f in (a.out / "streamed" / "model").rglob("*") if f.is_file())
        print(json.dumps({"model": str(a.model), "lora": a.lora, "quantize_base": a.quantize_base,
                          "processes": rt.world_size, "device": str(rt.device), "gb": round(size / 1e9, 2),
                          "seconds": seconds, "host_peak_gb_streamed": streamed.gb,
                          "host_peak_gb_host": gathered.gb, "same_bytes": same}), flush=True)
        shutil.rmtree(a.out)
    rt.teardown()


if __name__ == "__main__":
    main()
