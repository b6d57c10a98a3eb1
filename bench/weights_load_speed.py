"""How fast a HF folder's safetensors reach GPU memory, per way of reading them (issue 19: the 8B teacher's weights
took ~10 s of a 30 s first step on a second run).

Every way fills the same preallocated GPU tensors (as `load_state_dict` fills a model built on the GPU) from the
folder's files, which are in the page cache (read once before timing, as on a second run):

- `mmap_copy`: what `load_model` does today: `safetensors.torch.load_file` (a memory map), then `dst.copy_(src)`
  per tensor (pageable memory: the CUDA driver copies through its own staging buffer, faulting the map in 4 KiB
  pages on the way);
- `mmap_copy_threads`: the same copies spread over threads (torch releases the GIL during a copy);
- `safe_open_cuda`: safetensors' own `safe_open(device="cuda")`;
- `stream_T[_cMiB]`: what `load_model` does for a GPU build now (components/models/stream_load.py): plain
  `readinto` into two pinned buffers of c MiB (default 16) per thread, each copied asynchronously to the GPU while
  the other is read, T threads over contiguous runs of the files.

    python bench/weights_load_speed.py --model /tmp/kdb/teacher_8b [--repeat 2] [--ways mmap_copy,stream_4,...]

One JSON line per way and repeat: seconds and GB/s; every way's tensors are checked equal to the first way's.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llm_recipe.components.models import stream_load


def destinations(stored: dict[str, stream_load.StoredTensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in stored.items()}


def mmap_copy(files, dst, threads: int = 1) -> None:
    for path in files:
        sd = load_file(path)
        if threads == 1:
            for k, v in sd.items():
                dst[k].copy_(v)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda kv: dst[kv[0]].copy_(kv[1]), sd.items()))
        del sd


def safe_open_cuda(files, dst, device) -> None:
    for path in files:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for k in f.keys():
                dst[k].copy_(f.get_tensor(k))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cpu: checks the ways' bytes without a GPU (nothing pinned)")
    p.add_argument("--ways", default="mmap_copy,mmap_copy_threads,safe_open_cuda,stream_1,stream_2,stream_4,"
                                     "stream_8,stream_4_c16,stream_8_c64")
    a = p.parse_args()
    device = torch.device(a.device)
    stored = stream_load.stored_tensors(a.model)
    if stored is None:
        raise SystemExit(f"{a.model}: no readable safetensors")
    files = sorted({t.path for t in stored.values()})
    nbytes = sum(f.stat().st_size for f in files)
    for path in files:  # into the page cache, as on a second run
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    ways = {
        "mmap_copy": lambda d: mmap_copy(files, d),
        "mmap_copy_threads": lambda d: mmap_copy(files, d, a.threads),
        "safe_open_cuda": lambda d: safe_open_cuda(files, d, device),
    }

    def stream_way(name: str):
        parts = name.split("_")[1:]  # stream_T or stream_T_cMiB
        threads = int(parts[0])
        chunk = int(parts[1][1:]) << 20 if len(parts) > 1 else stream_load.CHUNK_BYTES
        return lambda d: stream_load.read_into(d, stored, threads=threads, chunk_bytes=chunk)

    reference = None
    for name in a.ways.split(","):
        for rep in range(a.repeat):
            dst = destinations(stored, device)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            (ways[name] if name in ways else stream_way(name))(dst)
            sync()
            s = time.perf_counter() - t0
            if reference is None:
                reference = {k: v.view(-1)[:: max(1, v.numel() // 4096)].clone() for k, v in dst.items()}
            same = all(torch.equal(dst[k].view(-1)[:: max(1, dst[k].numel() // 4096)], r) for k, r in reference.items())
            print(json.dumps({"way": name, "repeat": rep, "seconds": round(s, 2), "gb_per_s": round(nbytes / s / 1e9, 2),
                              "bytes": nbytes, "files": len(files), "same_as_first": same}), flush=True)
            del dst
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
