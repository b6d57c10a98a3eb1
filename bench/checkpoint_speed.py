"""Where a one-process checkpoint's time goes (session 49: shipped lora/qwen2_5_7b on one H200 wrote its 15.5 GB
final checkpoint in 38.2 s, silent under a finished progress bar).

On a model loaded the way the recipe loads it (`load_model` on the device, optionally with the LoRA section):

- `stream`: what `TrainState.save` writes now: `save_model(model)` streams the HF folder from the device
  (components/checkpoint/stream_save.py: adapters merged on the device, chunks through pinned buffers), fsync
  included; `host_peak_gb_stream`: the process's peak resident memory growth during it (sampled);
- the copying path it replaced (session 50), each part on its own: `gather` (`rt.full_state_dict`: every tensor
  copied from the device to host memory), `merge` (`merged_state_dict`: the host copy cloned, adapters merged in
  fp32 one module at a time), `write` (that host dict written into an atomic directory);
- `hash`: `write_manifest` (xxHash of every file, threads);
- `clone_model`: `clone_hf_folder` of that folder, as `write_final_model` makes model/ where the filesystem clones
  (`clones`: whether it did; where not, model/ is streamed again, as `stream`);
- `copy_model`: a plain copy of that folder's files (shutil.copytree: the kernel's copy), the alternative session 49
  shipped and session 50 measured slower than streaming again.

    python bench/checkpoint_speed.py --model /tmp/kdb/qwen_7b --lora --out /tmp/ckpt_speed [--device cuda]

One JSON line: seconds per part, GB written, the filesystem of --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import torch


def parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The options of this script and of final_model_speed.py: a model folder, with or without LoRA."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF folder")
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lora", action="store_true", help="the shipped Qwen LoRA section: r8 on every projection")
    return p


class PeakRss:
    """Peak growth of this process's resident memory while inside, in GB: the current RSS (/proc/self/statm)
    sampled every 5 ms in a thread. Why not getrusage's ru_maxrss: it is the peak since the process started, so a
    part using less than the model load's own peak would read as 0 (review of session 50)."""

    def __enter__(self) -> PeakRss:
        import os
        import threading

        page = os.sysconf("SC_PAGE_SIZE")
        self._rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
        self.base, self.peak, self._stop = self._rss(), 0, threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, self._rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def gb(self) -> float:
        return round(max(self.peak - self.base, 0) / 1e9, 2)


def qwen_lora(enabled: bool, quantize_base: str | bool = False):
    """lora/qwen2_5_7b's LoRA section, or None."""
    from llm_recipe.components.models import LoRASettings

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return LoRASettings(rank=8, alpha=16.0, targets=targets, quantize_base=quantize_base) if enabled else None


def main() -> None:
    a = parser(__doc__, "/tmp/ckpt_speed").parse_args()

    from llm_recipe.components.checkpoint.atomic import atomic_directory
    from llm_recipe.components.checkpoint.manifest import MANIFEST, write_manifest
    from llm_recipe.components.models import load_model, save_model
    from llm_recipe.components.models.hf_io import clone_hf_folder
    from llm_recipe.components.models.loader import merged_state_dict
    from llm_recipe.components.runtime import setup_runtime

    rt = setup_runtime(a.device, "bf16", 0)
    lora = qwen_lora(a.lora)
    model, args = load_model(a.model, dtype=rt.dtype, device=rt.device, lora=lora)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    seconds = {}

    def timed(name, fn):
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        seconds[name] = round(time.perf_counter() - t, 2)
        return result

    def stream() -> None:
        with atomic_directory(a.out / "streamed") as tmp:
            save_model(model, args, tmp, a.model)

    with PeakRss() as streamed:
        timed("stream", stream)
    shutil.rmtree(a.out / "streamed")  # the disk of a GPU machine holds one 15 GB copy at a time beside the model
    with PeakRss() as copying:
        full = timed("gather", lambda: rt.full_state_dict(model))
        merged = timed("merge", lambda: merged_state_dict(model, full))
        ckpt = a.out / "step"

        def write() -> None:
            with atomic_directory(ckpt) as tmp:
                save_model(model, args, tmp, a.model, state_dict=merged)

        timed("write", write)
        timed("hash", lambda: write_manifest(ckpt))
        clones = timed("clone_model", lambda: clone_hf_folder(ckpt, a.out / "model", skip=(MANIFEST,)))
        timed("copy_model", lambda: shutil.copytree(ckpt, a.out / "copied", ignore=shutil.ignore_patterns(MANIFEST)))
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    fs = subprocess.run(["df", "-T", str(a.out)], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    print(json.dumps({"model": str(a.model), "lora": a.lora, "device": str(rt.device), "gb": round(size / 1e9, 2),
                      "filesystem": fs, "clones": clones, "seconds": seconds, "host_peak_gb_stream": streamed.gb,
                      "host_peak_gb_copying": copying.gb, "cpu_threads": torch.get_num_threads()}),
          flush=True)
    shutil.rmtree(a.out)  # 30 GB: the next stage's run needs the disk


if __name__ == "__main__":
    main()
